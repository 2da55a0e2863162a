"""Warm-up: every batch shape class runs once, on the engine thread, before the engine reports
ready; afterwards the engine is as fresh as a new one (blocks, cache, counters, outputs)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine.async_engine as async_engine_module
from engine import LLM
from engine.async_engine import AsyncEngine, EngineWarmingUp
from engine.llm_engine import LLMEngine
from engine.model_runner import ScheduledSeq
from engine.sampling_params import SamplingParams
from engine.warmup import SHAPE_CLASSES, warm_up
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens

DEADLINE_S = 60.0


@pytest.fixture
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, block_size=4, num_kv_blocks=256, max_num_seqs=8)


def record_steps(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> list[list[tuple]]:
    """Each step the model runs: per sequence (new tokens, tokens already computed)."""
    steps: list[list[tuple]] = []
    execute = engine.runner.execute

    def spy(seqs: list[ScheduledSeq]):  # noqa: ANN202
        steps.append([(s.num_new_tokens, s.request.num_computed_tokens) for s in seqs])
        return execute(seqs)

    monkeypatch.setattr(engine.runner, "execute", spy)
    return steps


def test_warm_up_runs_every_shape_class(monkeypatch, engine) -> None:
    steps = record_steps(monkeypatch, engine)
    report = warm_up(engine)
    assert report.shape_classes == list(SHAPE_CLASSES)
    assert report.steps == len(steps) > 0
    # A long prefill from position 0, alone.
    assert any(len(s) == 1 and s[0][0] >= 64 and s[0][1] == 0 for s in steps)
    # A batch-1 decode and a decode of several sequences together.
    assert any(s == [(1, s[0][1])] for s in steps)
    assert any(len(s) >= 2 and all(n == 1 for n, _ in s) for s in steps)
    # A prefill over cached context (a prefix hit), and a step mixing decodes and a prefill.
    assert any(n > 1 and computed > 0 for s in steps for n, computed in s)
    assert any(any(n == 1 for n, _ in s) and any(n > 1 for n, _ in s) for s in steps if len(s) > 1)


def test_warm_up_leaves_a_fresh_engine(engine, tiny_llama) -> None:
    warm_up(engine)
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.cached_hashes() == []
    assert engine.kv.req_blocks == {} and not engine.has_unfinished_requests()
    assert engine.stats.num_steps == engine.stats.prompt_tokens == 0
    assert engine.stats.generation_tokens == 0 and not engine.stats.finished
    assert engine.scheduler.num_preemptions_total == 0
    # What it generates next is what a fresh engine generates.
    prompts = [tokens(30, 1), tokens(7, 2)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {"r0": [], "r1": []}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
    reference = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    expected = reference.generate(prompts, [params, params])
    assert [out["r0"], out["r1"]] == [o.token_ids for o in expected]
    assert engine.stats.prompt_tokens == 37 and engine.stats.num_steps > 0


def test_warm_up_reports_each_step(engine) -> None:
    calls = []
    report = warm_up(engine, on_step=lambda: calls.append(engine.stats.num_steps))
    # Called after every step, in order (the counters are reset only at the end).
    assert calls == list(range(1, report.steps + 1))


def test_warm_up_refuses_a_busy_engine(engine) -> None:
    engine.add_request("busy", tokens(5, 0), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(engine)


@pytest.fixture
def gated_warm_up(monkeypatch) -> Iterator[tuple[threading.Event, threading.Event, list]]:
    """The engine thread's warm-up, held at its start until ``release`` is set."""
    started, release, threads = threading.Event(), threading.Event(), []

    def gated(engine: LLMEngine, on_step=None):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(DEADLINE_S)
        return warm_up(engine, on_step=on_step)

    monkeypatch.setattr(async_engine_module, "warm_up", gated)
    yield started, release, threads
    release.set()


def test_health_turns_ok_only_after_the_warm_up(engine, gated_warm_up) -> None:
    started, release, threads = gated_warm_up
    ae = AsyncEngine(engine, idle_wait_s=0.01)
    try:
        ae.start(warm_up=True)
        assert started.wait(DEADLINE_S)
        assert threads == ["engine-loop"]
        with pytest.raises(EngineWarmingUp):
            ae.check_health()
        assert not ae.is_ready and ae.is_alive
        assert ae.wait_ready(timeout=0.2) is False

        async def request() -> list[int]:
            out: list[int] = []
            params = SamplingParams(max_tokens=3, temperature=0.0)
            async for batch in ae.generate("early", tokens(6, 3), params):
                out += [t for d in batch for t in d.new_token_ids]
            return out

        async def during_warm_up() -> list[int]:
            # Accepted while warming up; served once the warm-up is over.
            task = asyncio.create_task(request())
            await asyncio.sleep(0.2)
            assert not task.done()
            release.set()
            return await asyncio.wait_for(task, DEADLINE_S)

        assert len(asyncio.run(during_warm_up())) == 3
        assert ae.wait_ready(timeout=DEADLINE_S)
        ae.check_health()
        assert ae.is_ready
        assert ae.warmup_report is not None
        assert ae.warmup_report.shape_classes == list(SHAPE_CLASSES)
        # The early request is all the engine counts.
        assert engine.stats.generation_tokens == 3
    finally:
        ae.shutdown(timeout=5.0)


def test_without_warm_up_the_engine_is_ready_at_once(engine) -> None:
    ae = AsyncEngine(engine, idle_wait_s=0.01)
    try:
        ae.start()
        ae.check_health()
        assert ae.is_ready and ae.warmup_report is None
    finally:
        ae.shutdown(timeout=5.0)
