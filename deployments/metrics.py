"""Prometheus metrics: recorded per engine replica, rendered once for the whole application.

Each engine replica keeps its own prometheus_client registry (counters mirrored from the engine's
cumulative ``EngineStats``, gauges, latency histograms) and ships a plain, picklable snapshot of
it to the replica registry actor. The ingress's ``/metrics`` merges the snapshots of every live
replica into one exposition, each sample labelled with its ``replica``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from deployments.vllm_metrics import VllmMetrics
from engine.llm_engine import EngineStats

# `_created` series double the exposition for no use here.
disable_created_metrics()

LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# One registry's families as plain data: [{"name", "type", "documentation", "samples"}].
Snapshot = list[dict[str, Any]]


NAMESPACE_MISMATCH_DOC = (
    "Requests whose block hashes were made under another KV namespace (other weights, dtype or "
    "KV layout, e.g. sent before the sender saw a redeploy): rehashed under the replica's own, "
    "so no block of the other namespace is looked up."
)


class ReplicaMetrics:
    """The metrics of one engine replica."""

    def __init__(self, replica_id: str, model_name: str = "", ray_export: bool = False) -> None:
        self.replica_id = replica_id
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The same quantities under vLLM's names and model_name label (docs/metrics.md).
        self.vllm = VllmMetrics(r, model_name, replica_id, ray_export=ray_export)
        labels = ["replica"]
        self.prompt_tokens = Counter(
            "prefixserve_prompt_tokens", "Prompt tokens admitted.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "prefixserve_generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.cache_hits = Counter(
            "prefixserve_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache, by where the KV came from.",
            ["replica", "source"],
            registry=r,
        )
        self.requests = Counter(
            "prefixserve_requests",
            "Finished requests by finish reason.",
            ["replica", "finish_reason"],
            registry=r,
        )
        self.preemptions = Counter(
            "prefixserve_num_preemptions", "Requests preempted for KV space.", labels, registry=r
        )
        self.deadline_missed = Counter(
            "prefixserve_requests_deadline_missed",
            "Requests whose first token missed their deadline_ms, by action: rejected (429 at "
            "admission, with engine.reject_late_requests) or late (served after it).",
            ["replica", "action"],
            registry=r,
        )
        self.admission_watermark = Gauge(
            "prefixserve_kv_admission_watermark_blocks",
            "KV blocks in use up to which new requests are admitted: lowered after preemptions, "
            "recovering as requests finish.",
            labels,
            registry=r,
        )
        self.warmup_seconds = Gauge(
            "prefixserve_engine_warmup_seconds",
            "Seconds the engine spent warming up (each batch shape class once) before the "
            "replica reported ready.",
            labels,
            registry=r,
        )
        self.running = Gauge(
            "prefixserve_num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self.waiting = Gauge(
            "prefixserve_num_requests_waiting",
            "Requests waiting to be scheduled.",
            labels,
            registry=r,
        )
        self.kv_usage = Gauge(
            "prefixserve_kv_cache_usage_ratio",
            "Fraction of KV blocks held by requests (cached free blocks count as free).",
            labels,
            registry=r,
        )
        self.kv_free = Gauge(
            "prefixserve_kv_cache_free_blocks",
            "Free KV blocks (cached or not).",
            labels,
            registry=r,
        )
        self.kv_total = Gauge(
            "prefixserve_kv_cache_blocks", "KV blocks in the pool.", labels, registry=r
        )
        self.ttft = Histogram(
            "prefixserve_time_to_first_token_seconds",
            "Time from arrival at the engine replica to the first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "prefixserve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.native_kernels = Gauge(
            "prefixserve_native_kernels_available",
            "1 when the engine's native CPU kernels are loaded; 0 with the reason they are not "
            "(no_compiler, build_failed, not_linux, disabled): the slower PyTorch path runs.",
            ["replica", "reason"],
            registry=r,
        )
        # Create the labelled children now so every family is exported from the start.
        for source in ("local", "remote"):
            self.cache_hits.labels(replica=replica_id, source=source)
        for action in ("rejected", "late"):
            self.deadline_missed.labels(replica=replica_id, action=action)
        for child in (self.prompt_tokens, self.generation_tokens, self.preemptions):
            child.labels(replica=replica_id)
        self.extra_counters: dict[str, Counter] = {}
        self._mirrored: dict[tuple, float] = {}

    def counter(self, name: str, documentation: str) -> Counter:
        """A replica-labelled counter created on first use (e.g. by KV sharing)."""
        c = self.extra_counters.get(name)
        if c is None:
            c = Counter(name, documentation, ["replica"], registry=self.registry)
            self.extra_counters[name] = c
        return c

    def _mirror(self, counter: Counter, value: float, **labels: str) -> None:
        """Advance a counter to a cumulative value read from the engine."""
        key = (counter._name, tuple(sorted(labels.items())))
        delta = value - self._mirrored.get(key, 0.0)
        if delta > 0:
            counter.labels(replica=self.replica_id, **labels).inc(delta)
            self._mirrored[key] = value

    def update(self, stats: EngineStats) -> None:
        self.vllm.update(stats)
        self._mirror(self.prompt_tokens, stats.prompt_tokens)
        self._mirror(self.generation_tokens, stats.generation_tokens)
        self._mirror(self.cache_hits, stats.cache_hit_tokens_local, source="local")
        self._mirror(self.cache_hits, stats.cache_hit_tokens_remote, source="remote")
        self._mirror(self.preemptions, stats.num_preemptions)
        for reason, count in list(stats.finished.items()):
            self._mirror(self.requests, count, finish_reason=reason)
        for action, count in list(stats.deadline_missed.items()):
            self._mirror(self.deadline_missed, count, action=action)
        rid = self.replica_id
        self.running.labels(replica=rid).set(stats.num_running)
        self.waiting.labels(replica=rid).set(stats.num_waiting)
        self.kv_usage.labels(replica=rid).set(stats.kv_usage)
        self.kv_free.labels(replica=rid).set(stats.num_free_blocks)
        self.kv_total.labels(replica=rid).set(stats.num_blocks)
        self.admission_watermark.labels(replica=rid).set(stats.admission_watermark_blocks)

    def set_native_kernels(self, unavailable_reason: str | None) -> None:
        """Export whether the native kernels are loaded (``engine.kernels.native``)."""
        reason = unavailable_reason or ""
        self.native_kernels.labels(replica=self.replica_id, reason=reason).set(0 if reason else 1)

    def observe_request(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.labels(replica=self.replica_id).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(replica=self.replica_id).observe(tpot_s)

    def snapshot(self) -> Snapshot:
        """Every family of this registry as plain data."""
        out = []
        for fam in self.registry.collect():
            out.append(
                {
                    "name": fam.name,
                    "type": fam.type,
                    "documentation": fam.documentation,
                    "samples": [(s.name, dict(s.labels), s.value) for s in fam.samples],
                }
            )
        return out


class _MergedCollector(Collector):
    def __init__(self, snapshots: Iterable[Snapshot]) -> None:
        self.snapshots = list(snapshots)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for snap in self.snapshots:
            for fam in snap:
                metric = families.get(fam["name"])
                if metric is None:
                    metric = Metric(fam["name"], fam["documentation"], fam["type"])
                    families[fam["name"]] = metric
                for name, labels, value in fam["samples"]:
                    metric.add_sample(name, labels, value)
        return list(families.values())


def render(snapshots: Iterable[Snapshot]) -> bytes:
    """One Prometheus text exposition of several replicas' snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MergedCollector(snapshots))
    return generate_latest(registry)


class AdmittedCounts:
    """An engine replica's admission figures: requests admitted and not yet finished (running,
    waiting, or in transit to the engine thread), their peak, the requests it refused (429)
    because it held its limit, and its role under prefill/decode disaggregation."""

    def __init__(self, registry: CollectorRegistry, replica_id: str, role: str) -> None:
        self.count = 0
        self.peak = 0
        labels = ["replica"]
        self.gauge = Gauge(
            "prefixserve_replica_requests_admitted",
            "Requests admitted to the engine replica and not yet finished (running, waiting, or "
            "in transit to the engine thread).",
            labels,
            registry=registry,
        ).labels(replica=replica_id)
        self.peak_gauge = Gauge(
            "prefixserve_replica_requests_admitted_peak",
            "Most requests the engine replica has held at once since it started.",
            labels,
            registry=registry,
        ).labels(replica=replica_id)
        self.rejected = Counter(
            "prefixserve_replica_requests_rejected",
            "Requests the engine replica refused (429) because it held its limit.",
            labels,
            registry=registry,
        ).labels(replica=replica_id)
        Gauge(
            "prefixserve_replica_role",
            "1 for the replica's role: colocated, or prefill / decode under disaggregation "
            "(join on replica to split any replica metric by role).",
            ["replica", "role"],
            registry=registry,
        ).labels(replica=replica_id, role=role).set(1)
        self.set(0)
        self.peak_gauge.set(0)

    def set(self, n: int) -> None:
        self.count = n
        self.gauge.set(n)
        if n > self.peak:
            self.peak = n
            self.peak_gauge.set(n)
