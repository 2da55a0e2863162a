"""AsyncEngine: the engine thread's failure modes, with a real engine on a tiny checkpoint.

A fault is injected into ``LLMEngine.step`` with monkeypatch; every live stream must end with
``EngineDeadError``, health checks must fail, and nothing may wait forever.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError, build_on_own_thread
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
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


def test_before_add_failure_is_confined_to_its_request(async_engine: AsyncEngine) -> None:
    def broken(_request: object) -> None:
        raise RuntimeError("KV import failed")

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(RuntimeError, match="KV import failed"):
            async for _ in async_engine.generate("bad", [5, 6], params, before_add=broken):
                pass
        return await consume(async_engine, "good", params)

    assert len(asyncio.run(asyncio.wait_for(run(), DEADLINE_S))) == 4
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
