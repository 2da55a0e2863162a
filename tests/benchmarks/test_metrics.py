"""Summary statistics computed from per-request results."""

from __future__ import annotations

import pytest

from benchmarks.metrics import RequestResult, distribution, format_table, summarize


def test_distribution_percentiles_interpolate() -> None:
    d = distribution(range(1, 101))
    assert d["count"] == 100
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p95"] == pytest.approx(95.05)
    assert d["p99"] == pytest.approx(99.01)
    assert (d["min"], d["max"]) == (1.0, 100.0)
    assert distribution([2.0], scale=1000)["p99"] == 2000.0
    empty = distribution([])
    assert empty["count"] == 0 and empty["p50"] is None and empty["mean"] is None


def _ok(index: int, **kw: object) -> RequestResult:
    r = RequestResult(index=index, outcome="ok", prompt_len=10, output_len=4)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_summarize_counts_tokens_ratio_and_replicas() -> None:
    results = [
        _ok(0, ttft=0.1, latency=0.4, itls=[0.1, 0.1, 0.1], num_chunks=4, prompt_tokens=100,
            completion_tokens=4, cached_tokens=50, replica="a", send_time=1.0, scheduled_time=0.5),
        # Coalesced: 8 tokens in 2 chunks; no usage details for the cache.
        _ok(1, ttft=0.2, latency=0.9, itls=[0.7], num_chunks=2, prompt_tokens=30,
            completion_tokens=8, replica="a"),
        # No usage at all: falls back to the sent prompt length and the chunk count.
        _ok(2, ttft=0.3, latency=0.3, num_chunks=1, replica="b"),
        RequestResult(index=3, outcome="error", error="HTTP 429: busy", replica="b"),
        RequestResult(index=4, outcome="error", error="HTTP 429: busy"),
        RequestResult(index=5, outcome="error", error="stream error: boom", replica="a"),
        RequestResult(index=6, outcome="cancelled", error="cancelled at the run time limit"),
    ]  # fmt: skip
    s = summarize(results, duration=2.0, num_not_sent=3)
    counts = [s[k] for k in ("num_requests", "completed", "failed", "cancelled", "not_sent")]
    assert counts == [10, 3, 3, 1, 3]
    assert s["total_input_tokens"] == 100 + 30 + 10
    assert s["total_output_tokens"] == 4 + 8 + 1
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(13 / 2)
    assert s["total_token_throughput"] == pytest.approx(153 / 2)
    assert s["tokens_per_chunk"] == pytest.approx(13 / 7)
    assert s["prefix_cache_hit_ratio"] == pytest.approx(0.5)  # only request 0 reports it
    assert s["replicas"] == {"counts": {"a": 3, "b": 2}, "num_replicas": 2, "max_share": 0.6}
    assert s["errors"] == ["HTTP 429: busy", "stream error: boom"]
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT: (0.4 - 0.1) / 3 and (0.9 - 0.2) / 7; request 2 has a single token.
    assert s["tpot_ms"]["count"] == 2
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 4 and s["itl_ms"]["max"] == pytest.approx(700.0)
    assert s["e2e_latency_ms"]["p50"] == pytest.approx(400.0)
    assert s["client_wait_ms"]["max"] == pytest.approx(500.0)
    table = format_table(s)
    assert "50.00%" in table and "a: 3, b: 2" in table and "stream error: boom" in table


def test_summarize_without_usage_or_replicas() -> None:
    s = summarize([_ok(0, ttft=0.1, latency=0.2, num_chunks=3)], duration=0.0)
    assert s["prefix_cache_hit_ratio"] is None
    assert s["replicas"] is None
    assert s["request_throughput"] == 0.0
    assert "Prefix cache hit ratio" in format_table(s)
