"""The vLLM-named metrics of one replica, fed by a real engine the way the replica feeds them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deployments.metrics import ReplicaMetrics
from deployments.vllm_metrics import ChoiceTimer
from engine import SamplingParams
from tests.deployments.support import parse_metrics, total
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens


def serve_one(engine, metrics: ReplicaMetrics, rid: str, prompt: list[int], n: int) -> None:
    """Run one request to the end, observing it as EngineReplica.generate does."""
    timer = ChoiceTimer(time.monotonic())
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    final = None
    while final is None:
        for delta in engine.step():
            timer.on_item(len(delta.new_token_ids))
            if delta.finished:
                final = delta
    metrics.update(engine.stats)
    metrics.vllm.observe_finished(timer, final)


def samples(metrics: ReplicaMetrics):
    from prometheus_client import generate_latest

    return parse_metrics(generate_latest(metrics.registry).decode())


def test_counters_gauges_and_histograms_follow_the_engine(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, block_size=16)
    metrics = ReplicaMetrics("r", "tiny")
    prompt = tokens(40, 0)
    serve_one(engine, metrics, "a", prompt, 6)
    serve_one(engine, metrics, "b", prompt, 4)
    m = samples(metrics)
    labels = {"model_name": "tiny", "replica": "r"}
    assert total(m, "vllm:prompt_tokens_total", **labels) == 80
    assert total(m, "vllm:generation_tokens_total", **labels) == 10
    assert total(m, "vllm:prefix_cache_queries_total", **labels) == 80
    # The second prompt finds the first's two full blocks.
    assert total(m, "vllm:prefix_cache_hits_total", **labels) == 32
    assert total(m, "vllm:external_prefix_cache_hits_total", **labels) == 0
    assert total(m, "vllm:request_success_total", finished_reason="length") == 2
    assert total(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert total(m, "vllm:num_requests_running") == 0
    assert total(m, "vllm:kv_cache_usage_perc") == 0
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert total(m, f"{name}_count") == 2, name
    assert total(m, "vllm:request_prompt_tokens_sum") == 80
    assert total(m, "vllm:request_generation_tokens_sum") == 10
    # One gap per token after the first.
    assert total(m, "vllm:inter_token_latency_seconds_count") == 5 + 3
    # The phases add up to the whole: queue + prefill + decode = e2e (one clock, one process).
    phases = sum(
        total(m, f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode")
    )
    assert phases == pytest.approx(total(m, "vllm:e2e_request_latency_seconds_sum"), abs=2e-3)
    assert total(m, "vllm:request_inference_time_seconds_sum") == pytest.approx(
        total(m, "vllm:request_prefill_time_seconds_sum")
        + total(m, "vllm:request_decode_time_seconds_sum"),
        abs=2e-3,
    )


def test_engine_stamps_scheduling_and_first_token(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_batched_tokens=16)
    before = time.monotonic()
    engine.add_request("a", tokens(40, 1), SamplingParams(max_tokens=3, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    stamps = {(d.scheduled_time, d.first_token_time) for d in deltas}
    # Set once: the same on every delta of the request, the prefill spanning three steps.
    ((scheduled, first),) = stamps
    assert before <= scheduled < first <= time.monotonic()


def test_coalesced_items_spread_their_interval() -> None:
    timer = ChoiceTimer(arrival=0.0)
    timer.on_item(2, now=1.0)  # the first item: TTFT, no gap
    timer.on_item(1, now=1.5)
    timer.on_item(4, now=2.5)
    assert timer.first_at == 1.0 and timer.last_at == 2.5
    assert timer.gaps == [0.5, 0.25, 0.25, 0.25, 0.25]
