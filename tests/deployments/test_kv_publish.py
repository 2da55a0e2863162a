"""A handed-off prompt's blocks published chunk by chunk (deployments.kv_publish), without a
cluster: a real engine computes the prompt in chunks; the KV directory and the object store are
in-process fakes that keep what they are given."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deployments.config import KVSharingArgs
from deployments.kv_publish import KVPublisher, to_numpy
from engine.kv_connector import KVBlocks, KVConnector
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, random_tokens

BLOCK = 16
CHUNK = 32  # max_num_batched_tokens: a 120-token prompt is chunks of 32, 32, 32 and 24 tokens


class Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    async def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeDirectory:
    """Keeps each published block's KV; ``publishes`` lists the hashes of every object."""

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.publishes: list[list[int]] = []
        self.contains = Remote(self._contains)
        self.publish = Remote(self._publish)

    def _contains(self, hashes: list[int]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))

    def _publish(self, owner: str, hashes: list[int], ref: list[Any], *rest: Any) -> int:
        self.publishes.append(list(hashes))
        for h, block in zip(hashes, ref[0], strict=True):
            self.blocks.setdefault(h, block)
        return len(hashes)


class EngineCalls:
    """``AsyncEngine.call`` run inline: the test drives the engine's steps itself."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return fn(self.engine)


class Chunks(KVConnector):
    def __init__(self, publisher: KVPublisher) -> None:
        self.publisher = publisher

    def load(self, request: Request, num_local_blocks: int) -> KVBlocks | None:
        return None

    def loaded(self, request: Request, num_installed: int, rejected: str | None) -> None:
        pass

    def on_prompt_computed(self, request: Request) -> None:
        self.publisher.on_prompt_computed(request)

    def on_prefill_chunk(self, request: Request) -> None:
        self.publisher.on_prefill_chunk(request)


class Count:
    value = 0

    def inc(self, n: int) -> None:
        self.value += n


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _setup(model: Path, async_scheduling: bool) -> tuple[LLMEngine, KVPublisher, FakeDirectory]:
    engine = make_engine(
        model, block_size=BLOCK, max_num_batched_tokens=CHUNK, async_scheduling=async_scheduling
    )
    directory = FakeDirectory()

    async def call_directory(method: Callable[[Any], Any]) -> Any:
        return await method(directory)

    publisher = KVPublisher(
        "prefill-0",
        EngineCalls(engine),  # type: ignore[arg-type]
        KVSharingArgs(min_blocks=4, max_blocks_per_object=32),
        call_directory,
        Count(),
        node_id=None,
        put=lambda arr: arr,  # the "reference" is the array itself
    )
    engine.kv_connector = Chunks(publisher)
    return engine, publisher, directory


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_of_earlier_chunks_are_published_before_the_last_chunk_runs(
    tiny_llama: Path, async_scheduling: bool
) -> None:
    engine, publisher, directory = _setup(tiny_llama, async_scheduling)

    async def body() -> None:
        prompt = random_tokens(120, seed=3)
        publisher.expect_handoff("h")
        request = engine.add_request("h", prompt, SamplingParams(max_tokens=1))
        hashes = list(request.block_hashes[: len(prompt) // BLOCK])  # 7 full blocks
        for step in range(1, 4):
            assert not engine.step()  # no token yet: the prompt is not all computed
            # Each chunk's full blocks reach the directory while the prefill goes on.
            await _until(lambda step=step: len(directory.blocks) == step * CHUNK // BLOCK)
        assert directory.publishes == [hashes[:2], hashes[2:4], hashes[4:6]]
        (delta,) = engine.step()  # the last chunk, and the first token
        assert delta.finished
        held, nbytes = await publisher.hand_off(hashes, "h")
        # Then only what the last chunk computed was left to publish.
        assert directory.publishes == [hashes[:2], hashes[2:4], hashes[4:6], hashes[6:]]
        assert (held, nbytes) == (7, 7 * publisher.block_nbytes)
        _, kv = engine.export_prefix(hashes)
        assert np.array_equal(np.stack([directory.blocks[h] for h in hashes]), to_numpy(kv))
        assert publisher._handoffs == {}

    asyncio.run(body())


def test_requests_not_handed_off_publish_nothing_mid_prefill(tiny_llama: Path):
    engine, publisher, directory = _setup(tiny_llama, async_scheduling=False)

    async def body() -> None:
        publisher.expect_handoff("gone")
        publisher.forget_handoff("gone")  # failed before its prefill
        engine.add_request("gone", random_tokens(120, seed=4), SamplingParams(max_tokens=1))
        engine.add_request("plain", random_tokens(120, seed=5), SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
            await asyncio.sleep(0.01)
        assert directory.publishes == []

    asyncio.run(body())
