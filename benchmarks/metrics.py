"""Per-request benchmark results and the summary computed from them.

Definitions (all latencies measured on the client with ``time.perf_counter``):

- TTFT: from sending the request to the arrival of the first SSE event with non-empty content.
- ITL: gaps between consecutive content-bearing events (a server that coalesces several tokens
  per event shows fewer, longer gaps; ``tokens_per_chunk`` reveals that).
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``, for requests with >= 2 output tokens.
- E2E latency: from sending the request to the end of its stream.
- Throughputs divide by the run's duration (first send to last completion) and count completed
  requests only; token counts come from ``usage`` when the server reports it.
- Prefix cache hit ratio: ``sum(cached_tokens) / sum(prompt_tokens)`` over completed requests whose
  usage reports ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

Outcome = Literal["ok", "error", "cancelled"]
PERCENTILES = (50, 95, 99)
MAX_ERRORS_REPORTED = 5


@dataclass
class RequestResult:
    """What the client saw for one request.

    Invariants: ``outcome == "ok"`` iff the server answered 200 and the stream ended without an
    error event; ``ttft`` is None iff no content arrived; ``len(itls) == max(0, num_chunks - 1)``
    for ok requests; times are seconds; ``send_time``/``scheduled_time`` are relative to the start
    of the run.
    """

    index: int
    outcome: Outcome = "error"
    error: str | None = None
    status_code: int | None = None
    prompt_len: int = 0  # tokens the client sent
    output_len: int = 0  # max_tokens the client asked for
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    num_chunks: int = 0  # content-bearing events
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float | None = None
    scheduled_time: float = 0.0
    send_time: float = 0.0
    replica: str | None = None
    output_text: str = ""

    @property
    def output_tokens(self) -> int:
        """usage.completion_tokens when reported, else the number of content events."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """Count, mean, min, max and the p50/p95/p99 (linear interpolation) of ``values * scale``."""
    arr = np.asarray(list(values), dtype=float) * scale
    stats: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        stats.update({"mean": None, "min": None, "max": None})
        stats.update({f"p{p}": None for p in PERCENTILES})
        return stats
    stats.update({"mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())})
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        stats[f"p{p}"] = float(v)
    return stats


def replica_distribution(results: Sequence[RequestResult]) -> dict[str, Any] | None:
    """Requests per ``x-engine-replica`` value (any outcome) and the largest share; None if the
    server never sent the header."""
    counts = Counter(r.replica for r in results if r.replica is not None)
    if not counts:
        return None
    total = sum(counts.values())
    return {
        "counts": dict(sorted(counts.items())),
        "num_replicas": len(counts),
        "max_share": max(counts.values()) / total,
    }


def prefix_cache_hit_ratio(results: Sequence[RequestResult]) -> float | None:
    reporting = [
        r
        for r in results
        if r.outcome == "ok" and r.cached_tokens is not None and r.prompt_tokens is not None
    ]
    prompt = sum(r.prompt_tokens or 0 for r in reporting)
    if not reporting or prompt == 0:
        return None
    return sum(r.cached_tokens or 0 for r in reporting) / prompt


def summarize(
    results: Sequence[RequestResult], duration: float, *, num_not_sent: int = 0
) -> dict[str, Any]:
    """The benchmark summary (JSON-serialisable; latencies in milliseconds)."""
    ok = [r for r in results if r.outcome == "ok"]
    failed = [r for r in results if r.outcome == "error"]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(r.num_chunks for r in ok)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.ttft is not None and r.latency is not None and r.output_tokens > 1
    ]
    errors: list[str] = []
    for r in failed:
        if r.error and r.error not in errors:
            errors.append(r.error)
    return {
        "num_requests": len(results) + num_not_sent,
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": sum(r.outcome == "cancelled" for r in results),
        "not_sent": num_not_sent,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "output_token_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "ttft_ms": distribution((r.ttft for r in ok if r.ttft is not None), 1000.0),
        "tpot_ms": distribution(tpots, 1000.0),
        "itl_ms": distribution((gap for r in ok for gap in r.itls), 1000.0),
        "e2e_latency_ms": distribution((r.latency for r in ok if r.latency is not None), 1000.0),
        "client_wait_ms": distribution((r.send_time - r.scheduled_time for r in results), 1000.0),
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "prefix_cache_hit_ratio": prefix_cache_hit_ratio(results),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "replicas": replica_distribution(results),
        "errors": errors[:MAX_ERRORS_REPORTED],
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(summary: dict[str, Any], title: str = "Benchmark summary") -> str:
    """A human-readable rendering of :func:`summarize`'s output."""
    rows: list[tuple[str, str]] = [
        ("Requests (completed/failed/cancelled/not sent)",
         f"{summary['completed']}/{summary['failed']}/{summary['cancelled']}/{summary['not_sent']}"),
        ("Duration (s)", _fmt(summary["duration_s"])),
        ("Total input tokens", _fmt(summary["total_input_tokens"])),
        ("Total output tokens", _fmt(summary["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(summary["request_throughput"], 3)),
        ("Output token throughput (tok/s)", _fmt(summary["output_token_throughput"])),
        ("Total token throughput (tok/s)", _fmt(summary["total_token_throughput"])),
        ("Tokens per stream chunk", _fmt(summary["tokens_per_chunk"])),
    ]  # fmt: skip
    ratio = summary["prefix_cache_hit_ratio"]
    rows.append(("Prefix cache hit ratio", "-" if ratio is None else f"{ratio:.2%}"))
    header = f"{'':<18}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}"
    latency_lines = [header]
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("itl_ms", "ITL (ms)"),
        ("e2e_latency_ms", "E2E (ms)"),
        ("client_wait_ms", "Client wait (ms)"),
    ):
        d = summary[key]
        cells = "".join(f"{_fmt(d[k], 1):>10}" for k in ("mean", "p50", "p95", "p99", "max"))
        latency_lines.append(f"{label:<18}{cells}")
    replicas = summary["replicas"]
    if replicas is not None:
        counts = ", ".join(f"{k}: {v}" for k, v in replicas["counts"].items())
        rows.append(("Requests per replica", counts))
        rows.append(("Max replica share", f"{replicas['max_share']:.2%}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{'=' * 20} {title} {'=' * 20}"]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["-" * len(lines[0]), *latency_lines]
    if summary["errors"]:
        lines += ["-" * len(lines[0]), "First errors:"]
        lines += [f"  {e}" for e in summary["errors"]]
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)
