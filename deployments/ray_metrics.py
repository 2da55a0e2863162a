"""The vLLM-named families in Ray's metrics pipeline too (``ray.util.metrics``).

Ray exports what a replica records there from every node's metrics agent, beside Ray's and
Serve's own metrics, prefixed ``ray_`` and with ``:`` (which OpenTelemetry names refuse)
written ``_``: ``vllm:num_requests_running`` becomes ``ray_vllm_num_requests_running``, the name
Ray Serve LLM's vLLM engines export under, so Ray's dashboards and a Prometheus that scrapes Ray
see the engine. Each value is recorded into both at once (``Mirrored``): nothing is re-read or
re-sent on a timer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram


def ray_name(name: str) -> str:
    """The name Ray records ``name`` under (Ray prefixes ``ray_`` when it exports)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Child:
    def __init__(self, prom: Any, ray_metric: Any, tags: dict[str, str]) -> None:
        self._prom = prom
        self._ray = ray_metric
        self._tags = tags

    def set(self, value: float) -> None:
        self._prom.set(value)
        self._ray.set(value, tags=self._tags)

    def inc(self, amount: float = 1.0) -> None:
        self._prom.inc(amount)
        if amount > 0:  # Ray's counters take positive increments only
            self._ray.inc(amount, tags=self._tags)

    def observe(self, value: float) -> None:
        self._prom.observe(value)
        self._ray.observe(value, tags=self._tags)


class Mirrored:
    """A prometheus_client family whose every recorded value also goes to a Ray metric of the
    same kind, labels and (for histograms) buckets."""

    def __init__(self, prom: Counter | Gauge | Histogram, documentation: str) -> None:
        from ray.util import metrics as ray_metrics

        self._prom = prom
        self._name = prom._name
        keys = tuple(prom._labelnames)
        name = ray_name(prom._name)
        if isinstance(prom, Counter):
            self._ray: Any = ray_metrics.Counter(name, documentation, tag_keys=keys)
        elif isinstance(prom, Gauge):
            self._ray = ray_metrics.Gauge(name, documentation, tag_keys=keys)
        else:
            buckets: Sequence[float] = [b for b in prom._upper_bounds if b != float("inf")]
            self._ray = ray_metrics.Histogram(
                name, documentation, boundaries=list(buckets), tag_keys=keys
            )

    def labels(self, **labels: str) -> _Child:
        return _Child(self._prom.labels(**labels), self._ray, labels)
