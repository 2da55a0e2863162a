"""``RequestTimings`` fed a real engine's deltas, choice by choice, as an engine replica feeds it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from deployments.engine_request import EngineRequest
from deployments.metrics import ReplicaMetrics
from deployments.request_timings import RequestTimings
from engine import SamplingParams
from engine.outputs import RequestDelta
from tests.deployments.support import parse_metrics, total
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens

LENGTHS = (3, 5)  # each choice's max_tokens: the first finishes first


def run_choices(tiny_llama: Path, timings: RequestTimings, steps: int | None = None) -> list[bool]:
    """Two choices of one prompt on a real engine, each delta fed as one item (at most
    ``steps`` engine steps); ``on_batch``'s answer after each."""
    engine = make_engine(tiny_llama, block_size=16)
    prompt = tokens(20, 3)
    for k, n in enumerate(LENGTHS):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"a-{k}", prompt, params)
    answers = []
    step = 0
    while engine.has_unfinished_requests() and (steps is None or step < steps):
        for delta in engine.step():
            answers.append(timings.on_batch(int(delta.request_id[-1]), [delta]))
        step += 1
    return answers


def request() -> EngineRequest:
    return EngineRequest("a", tokens(20, 3), SamplingParams(max_tokens=5), n=len(LENGTHS))


def samples(metrics: ReplicaMetrics) -> Any:
    return parse_metrics(generate_latest(metrics.registry).decode())


class RecordingTrace:
    """Stands in for ``tracing.ReplicaTrace``: the choices it was given."""

    def __init__(self) -> None:
        self.choices: list[tuple[int, RequestDelta]] = []

    def choice(self, k: int, timer: Any, delta: RequestDelta) -> None:
        self.choices.append((k, delta))


def test_done_once_every_choice_finished_and_each_recorded(tiny_llama: Path) -> None:
    metrics = ReplicaMetrics("r", "tiny")
    timings = RequestTimings(request(), metrics, log_requests=False)
    answers = run_choices(tiny_llama, timings)
    # Done exactly at the last choice's final delta, never before.
    assert answers[-1] is True and not any(answers[:-1])
    assert timings.unfinished() == []
    trace = RecordingTrace()
    timings.record(trace)
    assert [(k, d.num_output_tokens) for k, d in trace.choices] == [(0, 3), (1, 5)]
    m = samples(metrics)
    assert total(m, "prefixserve_time_to_first_token_seconds_count") == 2
    assert total(m, "prefixserve_time_per_output_token_seconds_count") == 2
    # Time to first token is the request's: one figure, observed once per finished choice.
    assert timings.first_at is not None
    ttft = timings.first_at - timings.arrival
    assert total(m, "prefixserve_time_to_first_token_seconds_sum") == pytest.approx(2 * ttft)
    assert total(m, "vllm:request_generation_tokens_sum") == sum(LENGTHS)
    assert total(m, "vllm:e2e_request_latency_seconds_count") == 2


def test_a_choice_cut_short_records_nothing(tiny_llama: Path) -> None:
    metrics = ReplicaMetrics("r", "tiny")
    timings = RequestTimings(request(), metrics, log_requests=False)
    # Long enough for the first choice to finish, not the second (as when a timeout ends it).
    answers = run_choices(tiny_llama, timings, steps=LENGTHS[0])
    assert not any(answers)
    assert timings.unfinished() == [1]
    trace = RecordingTrace()
    timings.record(trace)
    assert [k for k, _ in trace.choices] == [0]
    m = samples(metrics)
    assert total(m, "prefixserve_time_to_first_token_seconds_count") == 1
    assert total(m, "vllm:request_generation_tokens_sum") == LENGTHS[0]


def test_a_request_with_no_item_records_nothing() -> None:
    metrics = ReplicaMetrics("r", "tiny")
    timings = RequestTimings(request(), metrics, log_requests=False)
    assert timings.unfinished() == [0, 1]
    timings.record(None)
    m = samples(metrics)
    assert total(m, "prefixserve_time_to_first_token_seconds_count") == 0
    assert total(m, "vllm:e2e_request_latency_seconds_count") == 0


def test_request_log_lines(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ray.serve")
    timings = RequestTimings(request(), ReplicaMetrics("r", "tiny"), log_requests=True)
    run_choices(tiny_llama, timings)
    timings.record(None)
    lines = [r.getMessage() for r in caplog.records if r.name == "ray.serve"]
    assert lines[0] == "engine request added: prompt_tokens=20 max_tokens=5 n=2"
    finished = [line for line in lines if line.startswith("engine request finished")]
    assert len(finished) == 2
    assert all("finish_reason=length prompt_tokens=20" in line for line in finished)
    assert [line.split("output_tokens=")[1].split()[0] for line in finished] == ["3", "5"]


def test_silent_without_log_requests(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ray.serve")
    timings = RequestTimings(request(), ReplicaMetrics("r", "tiny"), log_requests=False)
    run_choices(tiny_llama, timings)
    timings.record(None)
    assert not [r for r in caplog.records if r.name == "ray.serve"]
