"""The simulator's report: hit ratios, latencies, throughput and balance of one run.

Definitions (times on the simulated clock; no network or Serve overhead is modelled):

- hit ratio: ``sum(cached prompt tokens at first admission) / sum(prompt tokens)`` over finished
  requests, as the live benchmark computes it from ``usage.prompt_tokens_details.cached_tokens``;
  ``remote_hit_ratio`` is the part of it imported from the KV directory;
- TTFT: from arrival to the end of the step that produced the first token; E2E: to the end of the
  step that produced the last one; ITL (inter-token latency, also called TBT): the gaps between
  consecutive output tokens of a request, pooled over every finished request (as vLLM's
  benchmark pools them), so a long request weighs by its token count;
- throughput: finished requests (and their prompt + output tokens) per second of makespan, from
  the first arrival to the last completion;
- balance: per replica, requests routed to it and busy seconds (the sum of its step times);
  ``max_over_mean`` is 1.0 for a perfectly even spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.sim.cluster import ClusterRun
from benchmarks.sim.replica import SimRequest

PERCENTILES = (50, 90, 99)


def distribution_ms(values: Sequence[float]) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float) * 1000.0
    if arr.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    out["max"] = float(arr.max())
    return out


def spread(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    mean = float(arr.mean()) if arr.size else 0.0
    return {
        "mean": mean,
        "max": float(arr.max()) if arr.size else 0.0,
        "min": float(arr.min()) if arr.size else 0.0,
        "max_over_mean": float(arr.max()) / mean if mean > 0 else 1.0,
        "cv": float(arr.std()) / mean if mean > 0 else 0.0,
    }


def summarize_run(run: ClusterRun) -> dict[str, Any]:
    done = [r for r in run.requests if r.finish_time is not None]
    prompt = sum(r.num_prompt_tokens for r in done)
    cached = sum(max(r.num_cached_tokens, 0) for r in done)
    remote = sum(min(r.num_remote_cached_tokens, max(r.num_cached_tokens, 0)) for r in done)
    output = sum(r.num_output_tokens for r in done)
    ttft = [r.first_token_time - r.arrival_time for r in done if r.first_token_time is not None]
    e2e = [r.finish_time - r.arrival_time for r in done]
    start = min((r.arrival_time for r in run.requests), default=0.0)
    end = max((r.finish_time for r in done), default=start)
    makespan = end - start
    per_second = (lambda x: x / makespan) if makespan > 0 else (lambda x: 0.0)
    routed = [r.num_routed for r in run.replicas]
    busy = [r.busy_s for r in run.replicas]
    summary: dict[str, Any] = {
        "num_requests": len(run.requests) + len(run.rejected),
        "completed": len(done),
        "rejected": len(run.rejected),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "remote_hit_ratio": remote / prompt if prompt else 0.0,
        "ttft_ms": distribution_ms(ttft),
        "e2e_ms": distribution_ms(e2e),
        "itl_ms": distribution_ms(itls(done)),
        "makespan_s": makespan,
        "request_throughput": per_second(len(done)),
        "token_throughput": per_second(prompt + output),
        "output_token_throughput": per_second(output),
        "requests_per_replica": spread(routed),
        "busy_s_per_replica": spread(busy),
        "utilization": spread([b / makespan if makespan > 0 else 0.0 for b in busy]),
        "preemptions": sum(r.num_preemptions for r in done),
        "policy_counters": dict(sorted(run.policy.counters.items())),
        "events": run.num_events,
        "sim_wall_s": run.wall_s,
    }
    if run.directory is not None:
        summary["directory"] = {
            "imports": run.directory.imports,
            "fetched_blocks": run.directory.imported_blocks,
            "entries": len(run.directory.state.entries),
            "published": run.directory.state.counters["published"],
            "evicted": run.directory.state.counters["evicted"],
        }
    return summary


def per_replica(run: ClusterRun) -> dict[str, list[float]]:
    """Per-replica series for plots: requests routed and busy seconds, in replica order."""
    return {
        "requests": [float(r.num_routed) for r in run.replicas],
        "busy_s": [r.busy_s for r in run.replicas],
    }


def ttfts(run: ClusterRun) -> list[float]:
    return [
        r.first_token_time - r.arrival_time for r in run.requests if r.first_token_time is not None
    ]


def itls(requests: Sequence[SimRequest]) -> np.ndarray:
    """Every gap between consecutive output tokens of ``requests``, in seconds."""
    gaps = [np.diff(r.token_times) for r in requests if len(r.token_times) > 1]
    return np.concatenate(gaps) if gaps else np.empty(0)
