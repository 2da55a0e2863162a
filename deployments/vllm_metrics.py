"""vLLM's metric names for what prefixserve measures too, so vLLM dashboards and alerts work.

Every family here carries vLLM's ``model_name`` label (the served model name) and our
``replica`` label; the names, types and meanings follow vLLM's Prometheus metrics
(docs/metrics.md maps each to its ``prefixserve_*`` counterpart). They live in the replica's own
registry beside the ``prefixserve_*`` families and reach ``/metrics`` the same way.

Latencies are measured in the engine replica's process with ``time.monotonic()``: the engine
stamps a request's first scheduling and first token (``RequestDelta``), the replica its arrival,
each stream item it receives and the last (its end). So "queue" includes the hand-over to the engine thread, and the
time before the replica (HTTP, routing) is in no histogram.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deployments.ray_metrics import Mirrored
from engine.llm_engine import EngineStats
from engine.outputs import RequestDelta

LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
# Token counts per request: 1-2-5 steps up to 100k tokens.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5) if m * 10**e <= 1e5)
FINISH_REASONS = ("stop", "length", "abort")


class VllmMetrics:
    """The vLLM-named families of one engine replica, in ``registry``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        replica_id: str,
        ray_export: bool = False,
    ) -> None:
        """``ray_export``: record every value in Ray's metrics pipeline too (a Ray worker only;
        see ``deployments.ray_metrics``)."""
        self.labels = {"model_name": model_name, "replica": replica_id}
        names = list(self.labels)
        r = registry

        def both(family: Any, doc: str) -> Any:
            return Mirrored(family, doc) if ray_export else family

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return both(Counter(name, doc, [*names, *extra], registry=r), doc)

        def gauge(name: str, doc: str) -> Any:
            return both(Gauge(name, doc, names, registry=r), doc)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return both(Histogram(name, doc, names, buckets=buckets, registry=r), doc)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full)."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens served from the prefix cache (imported blocks included).",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens served from KV blocks imported from another replica.",
        )
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted for KV space.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = counter(
            "vllm:request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival at the engine replica to the engine's first token.",
            LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens as the replica receives them.",
            LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival at the engine replica to the last token.",
            LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Arrival at the engine replica to first scheduling.",
            LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "First scheduling to the last token.",
            LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduling to the first token.",
            LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "First token to the last token.", LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request.",
            TOKEN_BUCKETS,
        )
        # Every family exported from the start (a dashboard's query resolves before traffic).
        for family in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.prefix_queries,
            self.prefix_hits,
            self.external_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.inference,
            self.prefill,
            self.decode,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        ):
            family.labels(**self.labels)
        for reason in FINISH_REASONS:
            self.success.labels(**self.labels, finished_reason=reason)
        self._mirrored: dict[tuple[str, str], float] = {}

    def _mirror(self, counter: Any, value: float, reason: str = "") -> None:
        """Advance a counter to a cumulative value read from the engine."""
        key = (counter._name, reason)
        delta = value - self._mirrored.get(key, 0.0)
        if delta > 0:
            child = (
                counter.labels(**self.labels, finished_reason=reason)
                if reason
                else counter.labels(**self.labels)
            )
            child.inc(delta)
            self._mirrored[key] = value

    def update(self, stats: EngineStats) -> None:
        """Mirror the engine's cumulative counters and current gauges."""
        self.running.labels(**self.labels).set(stats.num_running)
        self.waiting.labels(**self.labels).set(stats.num_waiting)
        self.kv_usage.labels(**self.labels).set(stats.kv_usage)
        hits = stats.cache_hit_tokens_local + stats.cache_hit_tokens_remote
        self._mirror(self.prefix_queries, stats.prompt_tokens)
        self._mirror(self.prefix_hits, hits)
        self._mirror(self.external_hits, stats.cache_hit_tokens_remote)
        self._mirror(self.preemptions, stats.num_preemptions)
        self._mirror(self.prompt_tokens, stats.prompt_tokens)
        self._mirror(self.generation_tokens, stats.generation_tokens)
        for reason, count in list(stats.finished.items()):
            self._mirror(self.success, count, reason=reason)

    def observe_finished(self, timer: ChoiceTimer, delta: RequestDelta) -> None:
        """One finished choice's latencies and lengths (``delta``: its final delta)."""
        labels = self.labels
        # The engine's own stamp when there is one: a non-streamed request's first item comes
        # only when its whole answer does.
        first = delta.first_token_time if delta.first_token_time is not None else timer.first_at
        if first is not None:
            self.ttft.labels(**labels).observe(first - timer.arrival)
            self.decode.labels(**labels).observe(timer.last_at - first)
            n = delta.num_output_tokens
            if n > 1:
                self.tpot.labels(**labels).observe((timer.last_at - first) / (n - 1))
        self.e2e.labels(**labels).observe(timer.last_at - timer.arrival)
        if delta.scheduled_time is not None:
            queue = max(0.0, delta.scheduled_time - timer.arrival)
            self.queue.labels(**labels).observe(queue)
            self.inference.labels(**labels).observe(timer.last_at - delta.scheduled_time)
            if delta.first_token_time is not None:
                prefill = delta.first_token_time - delta.scheduled_time
                self.prefill.labels(**labels).observe(prefill)
        self.request_prompt_tokens.labels(**labels).observe(delta.num_prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(delta.num_output_tokens)
        itl = self.itl.labels(**labels)
        for gap in timer.gaps:
            itl.observe(gap)


@dataclass
class ChoiceTimer:
    """When one choice of a request arrived, got its first item and each later one.

    ``gaps`` holds one inter-token interval per token of every item after the first: an item of
    k tokens that came ``t`` after the previous item counts k gaps of ``t / k`` (tokens coalesced
    into one item were made within that window); tokens that come with the first count none."""

    arrival: float
    first_at: float | None = None
    last_at: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def on_item(self, num_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first_at is None:
            self.first_at = now
        elif num_tokens > 0:
            self.gaps.extend([(now - self.last_at) / num_tokens] * num_tokens)
        self.last_at = now
