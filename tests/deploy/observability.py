"""Reading docs/metrics.md, the Grafana dashboard and the PodMonitor shipped in deploy/."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "prefixserve-dashboard.json"
PODMONITOR = ROOT / "deploy" / "kuberay" / "podmonitor.yaml"

_NAME = r"(?:vllm:[a-z0-9_:]+|prefixserve_[a-z0-9_]+)"
_DOC_NAME = re.compile(rf"`({_NAME})`")
_QUERY_NAME = re.compile(rf"(?<![\w:])({_NAME})")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def documented_metrics() -> set[str]:
    """Every metric name written in backticks in docs/metrics.md, as it appears in /metrics."""
    return set(_DOC_NAME.findall(METRICS_DOC.read_text()))


def documented_types() -> dict[str, str]:
    """The Type column of docs/metrics.md's vLLM table: exposition name -> gauge/counter/..."""
    out: dict[str, str] = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`vllm:"):
            out[cells[0].strip("`")] = cells[1]
    return out


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard's panels and template variables."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def queried_samples(expr: str) -> set[str]:
    """The metric sample names a PromQL expression (or Grafana label_values query) reads."""
    return set(_QUERY_NAME.findall(expr))


def family_of(sample: str, documented: set[str]) -> str:
    """The documented name a sample belongs to (a histogram's ``_bucket`` -> the histogram)."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if sample.endswith(suffix) and sample.removesuffix(suffix) in documented:
            return sample.removesuffix(suffix)
    return sample
