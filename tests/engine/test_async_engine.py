"""AsyncEngine: the engine thread's failure modes, with a real engine on a tiny checkpoint.

A fault or a stall is injected into ``LLMEngine.step`` with monkeypatch; every live stream must end
with ``EngineDeadError`` (``EngineStalledError`` once the watchdog's bound passes), health checks
must fail, and nothing may wait forever.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStalledError,
    build_on_own_thread,
)
from engine.config import EngineConfig
from engine.kv_connector import KVBlocks, KVConnector
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams

# Generous: a loaded 2-core CI box can stall a thread for a while; a hang fails at this bound.
DEADLINE_S = 20.0


@pytest.fixture
def engine(tiny_llama: Path) -> Iterator[LLMEngine]:
    yield LLMEngine(
        EngineConfig(
            model=str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8
        )
    )


@pytest.fixture
def async_engine(engine: LLMEngine) -> Iterator[AsyncEngine]:
    ae = AsyncEngine(engine, idle_wait_s=0.01)
    ae.start()
    yield ae
    ae.shutdown(timeout=5.0)


def long_params() -> SamplingParams:
    return SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)


async def consume(ae: AsyncEngine, request_id: str, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for batch in ae.generate(request_id, [5, 6, 7, 8, 9, 10], params):
        tokens.extend(t for d in batch for t in d.new_token_ids)
    return tokens


def fail_step_after(
    monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, n: int, started: threading.Event
) -> None:
    """Make ``engine.step`` raise on its ``n``-th call from now, once streams have tokens."""
    real_step = engine.step
    calls = 0

    def step() -> list:
        nonlocal calls
        calls += 1
        if calls >= n:
            started.set()
            raise RuntimeError("injected fault: CUDA error: device-side assert triggered")
        return real_step()

    monkeypatch.setattr(engine, "step", step)


def test_completes_and_frees_blocks(async_engine: AsyncEngine, engine: LLMEngine) -> None:
    async def run() -> list[list[int]]:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return await asyncio.gather(*(consume(async_engine, f"r{i}", params) for i in range(4)))

    outs = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert [len(o) for o in outs] == [12] * 4
    assert len({tuple(o) for o in outs}) == 1  # same prompt, greedy
    assert async_engine.num_streams == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    async_engine.check_health()


def test_leaving_a_stream_early_aborts_and_frees_blocks(
    async_engine: AsyncEngine, engine: LLMEngine
) -> None:
    async def run() -> None:
        stream = async_engine.generate("early", [5, 6, 7], long_params())
        async for _ in stream:
            break
        await stream.aclose()
        # The abort is a command for the engine thread: wait until it ran.
        while await async_engine.call(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert engine.stats.finished["abort"] == 1
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_step_fault_fails_every_live_stream_and_health(
    async_engine: AsyncEngine, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    died = threading.Event()

    async def run() -> list[BaseException | list[int]]:
        tasks = [
            asyncio.create_task(consume(async_engine, f"live{i}", long_params())) for i in range(5)
        ]
        await asyncio.sleep(0.2)  # every stream is registered and decoding
        fail_step_after(monkeypatch, engine, 3, died)
        return await asyncio.gather(*tasks, return_exceptions=True)

    deaths: list[BaseException] = []
    async_engine.on_death = deaths.append
    results = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert died.is_set()
    async_engine.shutdown(timeout=DEADLINE_S)  # joins the engine thread: on_death has run
    assert [str(d) for d in deaths] == ["injected fault: CUDA error: device-side assert triggered"]
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert all("injected fault" in str(r) for r in results)
    assert not async_engine.is_alive
    with pytest.raises(EngineDeadError, match="injected fault"):
        async_engine.check_health()
    assert async_engine.num_streams == 0


def test_after_death_new_requests_and_calls_fail_at_once(
    async_engine: AsyncEngine, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    died = threading.Event()
    fail_step_after(monkeypatch, engine, 1, died)

    async def run() -> None:
        with pytest.raises(EngineDeadError):
            await consume(async_engine, "first", long_params())
        with pytest.raises(EngineDeadError):
            await consume(async_engine, "second", long_params())
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda e: e.num_blocks)

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert died.is_set()


def test_pending_call_fails_when_the_loop_dies(
    async_engine: AsyncEngine, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``call`` queued behind a step that raises must not wait forever."""
    gate = threading.Event()
    died = threading.Event()

    def step() -> list:
        gate.wait(DEADLINE_S)  # hold the loop inside a step while the call is queued
        died.set()
        raise RuntimeError("injected fault in step")

    async def run() -> None:
        task = asyncio.create_task(consume(async_engine, "victim", long_params()))
        await asyncio.sleep(0.1)
        monkeypatch.setattr(engine, "step", step)
        await asyncio.sleep(0.1)  # the loop is now blocked in the patched step
        fut = async_engine.call(lambda e: e.num_blocks)
        gate.set()
        with pytest.raises(EngineDeadError):
            await fut
        with pytest.raises(EngineDeadError):
            await task

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert died.is_set()


def test_kv_connector_failure_only_costs_a_recompute(async_engine: AsyncEngine) -> None:
    class Broken(KVConnector):
        def load(self, request: Request, num_local_blocks: int) -> KVBlocks | None:
            raise RuntimeError("KV import failed")

        def loaded(self, request: Request, num_installed: int, rejected: str | None) -> None:
            pass

        def on_prompt_computed(self, request: Request) -> None:
            pass

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return await consume(async_engine, "broken-connector", params)

    async_engine.engine.kv_connector = Broken()
    try:
        assert len(asyncio.run(asyncio.wait_for(run(), DEADLINE_S))) == 4
    finally:
        async_engine.engine.kv_connector = None
    async_engine.check_health()


def test_invalid_request_raises_value_error_before_queueing(async_engine: AsyncEngine) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="token ids"):
            async for _ in async_engine.generate("oob", [10**9], SamplingParams()):
                pass

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert async_engine.num_streams == 0
    async_engine.check_health()


def test_shutdown_ends_live_streams(async_engine: AsyncEngine) -> None:
    deaths: list[BaseException] = []
    async_engine.on_death = deaths.append

    async def run() -> None:
        task = asyncio.create_task(consume(async_engine, "s", long_params()))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(async_engine.shutdown, 5.0)
        with pytest.raises(EngineDeadError, match="shut down"):
            await task

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    with pytest.raises(EngineDeadError):
        async_engine.check_health()
    assert deaths == []  # a shutdown is not a death


def test_item_budget_widens_the_window_with_the_number_of_streams(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="items_per_s"):
        AsyncEngine(engine, items_per_s=0)
    ae = AsyncEngine(engine, idle_wait_s=0.01, items_per_s=0.5)
    ae.start()
    try:

        async def run() -> list[list[list[int]]]:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

            async def items(request_id: str) -> list[list[int]]:
                return [
                    [t for d in batch for t in d.new_token_ids]
                    async for batch in ae.generate(request_id, [5, 6, 7, 8], params)
                ]

            streams = [items(f"r{i}") for i in range(4)]
            return await asyncio.gather(*streams)

        outs = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    finally:
        ae.shutdown(timeout=5.0)
    for out in outs:
        assert sum(len(item) for item in out) == 40
        # Four streams under 0.5 items/s: after the first item, an 8 s window, which a tiny
        # model's remaining tokens fit inside, so the final item carries the rest (the first
        # item may hold more than one token when the consumer was slower than the engine).
        assert len(out) <= 3, [len(i) for i in out]
    assert ae.num_streams == 0
    assert ae.window_s() == 0.0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity")
def test_engine_thread_keeps_to_its_cpus_and_only_it(engine: LLMEngine) -> None:
    before = os.sched_getaffinity(0)
    cpu = max(before)
    ae = AsyncEngine(engine, idle_wait_s=0.01, cpus=frozenset({cpu}))
    ae.start()

    async def main() -> set[int]:
        on_engine_thread = await ae.call(lambda _: os.sched_getaffinity(0))
        tokens = await asyncio.wait_for(
            consume(ae, "pinned", SamplingParams(max_tokens=4, temperature=0.0)), DEADLINE_S
        )
        assert len(tokens) == 4
        return on_engine_thread

    try:
        assert asyncio.run(main()) == {cpu}
        assert os.sched_getaffinity(0) == before  # the caller's thread is untouched
    finally:
        ae.shutdown(timeout=5.0)


def test_an_empty_cpu_set_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="cpus"):
        AsyncEngine(engine, cpus=frozenset())


def test_build_on_own_thread_runs_the_factory_on_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def factory() -> str:
        seen.append(threading.current_thread())
        return "built"

    assert build_on_own_thread(factory) == "built"
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()  # its OpenMP team went with it


def test_build_on_own_thread_raises_the_factory_error() -> None:
    def factory() -> None:
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        build_on_own_thread(factory)


# -- the watchdog --------------------------------------------------------------------------------

STALL_S = 0.5


@pytest.fixture
def watched(engine: LLMEngine) -> Iterator[tuple[AsyncEngine, list[BaseException]]]:
    """An AsyncEngine whose watchdog declares a stall after ``STALL_S``; its deaths recorded."""
    ae = AsyncEngine(engine, idle_wait_s=0.01, stall_timeout_s=STALL_S)
    deaths: list[BaseException] = []
    ae.on_death = deaths.append
    ae.start()
    yield ae, deaths
    ae.shutdown(timeout=DEADLINE_S)


def stall_step(
    monkeypatch: pytest.MonkeyPatch,
    engine: LLMEngine,
    stalled: threading.Event,
    release: threading.Event,
) -> None:
    """Make ``engine.step`` block, as a wedged kernel would, until ``release`` is set."""
    real_step = engine.step

    def step() -> list:
        stalled.set()
        release.wait(DEADLINE_S)
        return real_step()

    monkeypatch.setattr(engine, "step", step)


def test_a_stalled_step_fails_health_and_every_live_stream(
    watched: tuple[AsyncEngine, list[BaseException]],
    engine: LLMEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ae, deaths = watched
    stalled, release = threading.Event(), threading.Event()

    async def run() -> tuple[list[BaseException | list[int]], float]:
        tasks = [asyncio.create_task(consume(ae, f"live{i}", long_params())) for i in range(3)]
        await asyncio.sleep(0.2)  # every stream is registered and decoding
        stall_step(monkeypatch, engine, stalled, release)
        assert await asyncio.to_thread(stalled.wait, DEADLINE_S)
        stalled_at = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.monotonic() - stalled_at

    try:
        results, took = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
        # Every stream ended with the stall, after the bound and about a watchdog period more.
        assert all(isinstance(r, EngineStalledError) for r in results), results
        assert "engine thread stalled" in str(results[0]) and "limit 0.5 s" in str(results[0])
        assert STALL_S * 0.8 <= took <= STALL_S + 3.0, took
        with pytest.raises(EngineStalledError, match="engine thread stalled"):
            ae.check_health()
        assert not ae.is_alive
        assert len(deaths) == 1 and isinstance(deaths[0], EngineStalledError)
        # New work is refused at once rather than queued behind the stalled step.
        with pytest.raises(EngineStalledError):
            asyncio.run(asyncio.wait_for(consume(ae, "late", long_params()), DEADLINE_S))
        assert ae.num_streams == 0
    finally:
        release.set()
    # The stalled step returned at last: the loop leaves, without a second death.
    ae.shutdown(timeout=DEADLINE_S)
    assert ae._thread is not None and not ae._thread.is_alive()
    assert len(deaths) == 1


def test_a_stalled_command_fails_health_and_its_caller(engine: LLMEngine) -> None:
    ae = AsyncEngine(engine, idle_wait_s=0.01, stall_timeout_s=0.3)
    release = threading.Event()
    ae.start()
    try:

        async def run() -> None:
            fut = ae.call(lambda _: release.wait(DEADLINE_S))
            await asyncio.sleep(0.1)
            ae.check_health()  # busy, within the bound
            deadline = time.monotonic() + DEADLINE_S
            while True:
                try:
                    ae.check_health()
                except EngineStalledError:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            # The stalled command's own caller is not left waiting either.
            with pytest.raises(EngineStalledError):
                await asyncio.wait_for(fut, DEADLINE_S)

        asyncio.run(run())
    finally:
        release.set()
        ae.shutdown(timeout=DEADLINE_S)


def test_slow_steps_within_the_bound_and_idle_time_are_no_stall(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 1.0
    ae = AsyncEngine(engine, idle_wait_s=0.01, stall_timeout_s=bound)
    deaths: list[BaseException] = []
    ae.on_death = deaths.append
    real_step = engine.step

    def slow_step() -> list:
        time.sleep(bound * 0.4)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    ae.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        # Four steps of 0.4 s: longer in all than the bound, each well within it.
        assert len(asyncio.run(asyncio.wait_for(consume(ae, "slow", params), DEADLINE_S))) == 4
        time.sleep(bound * 2)  # idle, waiting for work
        ae.check_health()
        assert ae.is_alive and deaths == []
        assert len(asyncio.run(asyncio.wait_for(consume(ae, "after", params), DEADLINE_S))) == 4
    finally:
        ae.shutdown(timeout=DEADLINE_S)


def test_the_stall_bound_must_be_positive(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="stall_timeout_s"):
        AsyncEngine(engine, stall_timeout_s=0)


def first_step_requests(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> list[set[str]]:
    """Record the requests the engine holds at its first step (one set, once it has run)."""
    seen: list[set[str]] = []
    real_step = engine.step

    def step() -> list:
        if not seen:
            seen.append(set(engine.scheduler.requests))
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    return seen


def test_an_idle_engine_starts_a_burst_in_one_step(
    monkeypatch: pytest.MonkeyPatch, engine: LLMEngine
) -> None:
    with pytest.raises(ValueError, match="batch_wait"):
        AsyncEngine(engine, batch_wait_s=-1.0)
    seen = first_step_requests(monkeypatch, engine)
    ae = AsyncEngine(engine, idle_wait_s=0.01, batch_wait_s=1.0, batch_wait_max_s=5.0)
    ae.start()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:

        async def run() -> list[list[int]]:
            first = asyncio.ensure_future(consume(ae, "a", params))
            await asyncio.sleep(0.2)  # within the 1 s gap: b joins a's first step
            return await asyncio.gather(first, consume(ae, "b", params))

        outs = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    finally:
        ae.shutdown(timeout=5.0)
    assert seen == [{"a", "b"}]
    assert [len(o) for o in outs] == [4, 4]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_without_a_wait_the_first_request_of_a_burst_runs_alone(
    monkeypatch: pytest.MonkeyPatch, engine: LLMEngine
) -> None:
    seen = first_step_requests(monkeypatch, engine)
    ae = AsyncEngine(engine, idle_wait_s=0.01)  # batch_wait_s 0: no wait
    ae.start()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:

        async def run() -> None:
            first = asyncio.ensure_future(consume(ae, "a", params))
            await asyncio.sleep(1.0)
            await asyncio.gather(first, consume(ae, "b", params))

        asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    finally:
        ae.shutdown(timeout=5.0)
    assert seen == [{"a"}]


def small_step_engine(tiny_llama: Path, max_num_batched_tokens: int) -> LLMEngine:
    """An engine whose steps compute at most ``max_num_batched_tokens`` prompt tokens."""
    return LLMEngine(
        EngineConfig(
            model=str(tiny_llama),
            dtype="float32",
            device="cpu",
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )


@pytest.mark.parametrize("cached", [False, True])
def test_a_burst_behind_one_prefix_counts_the_prefix_once(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, cached: bool
) -> None:
    """The gather stops once the waiting prompts fill a step, counting what a step would
    compute: three prompts of a 32-token prefix + 8 tokens fill a 64-token step only if the
    prefix counts once (raw, two of them are 80 tokens), and once cached, not at all."""
    engine = small_step_engine(tiny_llama, 64)
    prefix = list(range(100, 132))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ae = AsyncEngine(engine, idle_wait_s=0.01, batch_wait_s=1.0, batch_wait_max_s=5.0)
    ae.start()

    async def consume_prompt(request_id: str, own: int) -> int:
        tokens = 0
        async for batch in ae.generate(request_id, [*prefix, *range(own, own + 8)], params):
            tokens += sum(len(d.new_token_ids) for d in batch)
        return tokens

    async def burst() -> list[int]:
        first = asyncio.ensure_future(consume_prompt("a", 10))
        await asyncio.sleep(0.2)  # each within the 1 s gap of the one before
        second = asyncio.ensure_future(consume_prompt("b", 20))
        await asyncio.sleep(0.2)
        return await asyncio.gather(first, second, consume_prompt("c", 30))

    try:
        if cached:
            asyncio.run(asyncio.wait_for(consume_prompt("warm", 40), DEADLINE_S))
        seen = first_step_requests(monkeypatch, engine)
        outs = asyncio.run(asyncio.wait_for(burst(), DEADLINE_S))
    finally:
        ae.shutdown(timeout=5.0)
    assert seen == [{"a", "b", "c"}]
    assert outs == [2, 2, 2]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_a_lone_request_waits_one_gap_and_a_full_step_none(tiny_llama: Path) -> None:
    engine = small_step_engine(tiny_llama, 16)
    ae = AsyncEngine(engine, idle_wait_s=0.01, batch_wait_s=2.0, batch_wait_max_s=30.0)
    ae.start()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def first_token_s(prompt: list[int], request_id: str) -> float:
        start = time.monotonic()
        async for _ in ae.generate(request_id, prompt, params):
            return time.monotonic() - start
        raise AssertionError("no output")

    try:
        lone = asyncio.run(asyncio.wait_for(first_token_s([5, 6, 7, 8], "lone"), DEADLINE_S))
        # A prompt that fills a step by itself: nothing could join it, so it does not wait.
        full = asyncio.run(asyncio.wait_for(first_token_s(list(range(5, 25)), "full"), DEADLINE_S))
    finally:
        ae.shutdown(timeout=5.0)
    assert lone >= 2.0
    assert full < 1.0, full
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
