"""Helpers for the robustness tests: metrics scraping, SSE parsing, process memory, percentiles."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(base_url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> Samples:
    r = httpx.get(f"{base_url}/metrics", headers=headers, timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def total(m: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def per_label(m: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples keyed by the value of ``label`` (e.g. per replica)."""
    return {dict(lab)[label]: v for (n, lab), v in m.items() if n == name and label in dict(lab)}


def idle_state(m: Samples) -> dict[str, float]:
    """The figures that must all be zero when nothing runs and no KV block leaked."""
    return {
        "running": total(m, "prefixserve_num_requests_running"),
        "waiting": total(m, "prefixserve_num_requests_waiting"),
        "admitted": total(m, "prefixserve_replica_requests_admitted"),
        "in_flight": total(m, "prefixserve_ingress_requests_in_flight"),
        "kv_usage": total(m, "prefixserve_kv_cache_usage_ratio"),
        "blocks_leaked": total(m, "prefixserve_kv_cache_blocks")
        - total(m, "prefixserve_kv_cache_free_blocks"),
    }


def wait_until_idle(
    base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 30
) -> dict[str, float]:
    """Poll /metrics until every figure of ``idle_state`` is zero; return the last state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = idle_state(scrape(base_url, headers))
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the final ``[DONE]``."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def processes_rss(match: Callable[[str], bool], pids: set[int] | None = None) -> dict[int, int]:
    """Resident memory in bytes of this machine's processes (among ``pids`` if given) whose
    command line matches."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (pids is not None and int(proc.name) not in pids):
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not match(cmdline):
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[int(proc.name)] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return out


def serve_rss(app_name: str = "prefixserve") -> int:
    """Total resident memory of this cluster's HTTP proxy and the application's Serve replicas
    (found through Ray, so that other clusters on the machine do not count)."""
    import ray

    def pid(_: Any) -> int:
        return os.getpid()

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve"
        and (a["name"].startswith(f"SERVE_REPLICA::{app_name}#") or "PROXY" in a["name"])
    ]
    pids = ray.get(
        [ray.get_actor(n, namespace="serve").__ray_call__.remote(pid) for n in names], timeout=60
    )
    rss = processes_rss(lambda _: True, pids=set(pids))
    return sum(rss.values())


def engine_replica_ids(m: Samples) -> set[str]:
    return set(per_label(m, "prefixserve_kv_cache_blocks", "replica"))


def refused_field(call: Callable[[], Any]) -> str | None:
    """The request field that the 400 raised by ``call()`` names (request validation)."""
    from deployments.http_errors import HTTPError

    try:
        call()
    except HTTPError as e:
        assert e.status == 400, e
        return e.param
    raise AssertionError("the request was accepted")
