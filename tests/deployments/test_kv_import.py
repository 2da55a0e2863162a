"""Importing published KV inside one process: two engines, a real directory actor and Ray's object
store, no Serve. Single-flight fetches, the byte bound on fetches, layout refusal, and the
directory's budget against what the object store really pins."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from deployments.config import KVSharingArgs
from deployments.kv_directory import BlockLayout, KVDirectory
from deployments.kv_sharing import HeldDirectory, KVSharing
from deployments.metrics import ReplicaMetrics
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.ray

PREFIX_TOKENS = 1024
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("long-llama"), max_position_embeddings=2048)


@pytest.fixture
def directory(serve_instance: str) -> Iterator[HeldDirectory]:
    # No replica reporter heartbeats here: owners must not expire mid-test.
    actor = KVDirectory.remote(capacity_bytes=256 << 20, owner_timeout_s=3600.0)
    yield HeldDirectory(actor)
    ray.kill(actor)


def _replica(model: Path, name: str, directory: HeldDirectory, **args: Any) -> KVSharing:
    config = EngineConfig(
        model=str(model), dtype="float32", num_kv_blocks=512, max_num_seqs=32, kv_hash_key="k" * 16
    )
    async_engine = AsyncEngine(LLMEngine(config))
    sharing = KVSharing(name, async_engine, KVSharingArgs(**args), directory, ReplicaMetrics(name))
    async_engine.start()
    return sharing


def _count(counter: Any) -> float:
    return counter._value.get()


async def _run(sharing: KVSharing, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """One request as a replica runs it: prefetch, then generate with what was fetched."""
    hashes = sharing.engine.make_request(rid, prompt, PARAMS).block_hashes
    fetched = await sharing.prefetch(len(prompt), hashes)
    tokens: list[int] = []
    remote = 0
    async for batch in sharing.async_engine.generate(rid, prompt, PARAMS, kv_transfer=fetched):
        tokens.extend(t for d in batch for t in d.new_token_ids)
        remote = batch[-1].num_remote_cached_tokens
    return tokens, remote


async def _published(sharing: KVSharing, prompt: list[int], blocks: int) -> None:
    hashes = sharing.engine.make_request("probe", prompt, PARAMS).block_hashes
    for _ in range(200):
        if await sharing.directory.contains.remote(hashes) >= blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the prefix was never published")


def test_a_burst_on_one_uncached_prefix_fetches_once(long_llama: Path, directory: HeldDirectory):
    rng = random.Random(11)
    prefix = [rng.randrange(3, 512) for _ in range(PREFIX_TOKENS)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(20)] for _ in range(32)]
    owner = _replica(long_llama, "owner", directory)
    importer = _replica(long_llama, "importer", directory)

    async def main() -> tuple[list, list]:
        owner.start()
        # The owner computes and publishes the prefix alone (64 full blocks).
        await _run(owner, "seed", [*prefix, 7])
        await _published(owner, prefix, PREFIX_TOKENS // 16)
        burst = await asyncio.gather(*(_run(importer, f"b{i}", p) for i, p in enumerate(prompts)))
        # The reference: every prompt on the owner, which holds the prefix locally.
        expected = [await _run(owner, f"ref{i}", p) for i, p in enumerate(prompts)]
        return expected, list(burst)

    try:
        expected, burst = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        owner.async_engine.shutdown()
        importer.async_engine.shutdown()
    assert [tokens for tokens, _ in burst] == [tokens for tokens, _ in expected]
    assert _count(importer.fetches) == 1
    assert _count(importer.imported) == PREFIX_TOKENS // 16
    # Both engines run in this process: the fetch came from the importer's own node.
    assert importer.import_cost.node_id == ray.get_runtime_context().get_node_id()
    assert importer.import_cost.same_node_s_per_block is not None
    assert importer.import_cost.cross_node_s_per_block is None
    # The first request to be added installs the run; the others hit it locally.
    assert sorted(remote for _, remote in burst)[-1] == PREFIX_TOKENS
    importer.engine.kv.pool.check_invariants()
    assert importer.engine.kv.pool.num_free_blocks == importer.engine.kv.pool.num_blocks


def test_fetches_past_the_byte_bound_recompute(long_llama: Path, directory: HeldDirectory):
    rng = random.Random(12)
    prompt = [rng.randrange(3, 512) for _ in range(PREFIX_TOKENS)]
    owner = _replica(long_llama, "owner", directory)
    importer = _replica(long_llama, "importer", directory, max_import_bytes=4096)

    async def main() -> tuple[tuple, tuple]:
        owner.start()
        cold = await _run(owner, "seed", prompt)
        await _published(owner, prompt, PREFIX_TOKENS // 16)
        return cold, await _run(importer, "r", prompt)

    try:
        (cold, _), (warm, remote) = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        owner.async_engine.shutdown()
        importer.async_engine.shutdown()
    assert warm == cold and remote == 0
    assert _count(importer.skipped) == 1 and _count(importer.fetches) == 0


def test_entries_of_another_layout_are_never_fetched(long_llama: Path, directory: HeldDirectory):
    """An entry under this engine's hashes whose recorded layout differs (a forged or buggy
    publisher) is refused before any fetch: the prompt recomputes, the refusal is counted."""
    rng = random.Random(13)
    prompt = [rng.randrange(3, 512) for _ in range(200)]
    importer = _replica(long_llama, "importer", directory)
    hashes = importer.engine.make_request("p", prompt, PARAMS).block_hashes
    layout = importer.layout
    foreign = type(layout)("bfloat16", layout.block_shape)
    ref = ray.put(b"\0" * 64)
    ray.get(directory.publish.remote("forger", hashes, [ref], 8, foreign))

    async def main() -> tuple[list[int], int]:
        return await _run(importer, "r", prompt)

    try:
        _, remote = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        importer.async_engine.shutdown()
    assert remote == 0
    assert _count(importer.rejected) == 1 and _count(importer.fetches) == 0


def _plasma_bytes() -> int:
    """Bytes in the cluster's object stores, from Ray's own stats (MiB resolution)."""
    from ray._private.internal_api import memory_summary

    summary = memory_summary(stats_only=True)
    match = re.search(r"Plasma memory usage (\d+) MiB", summary)
    assert match is not None, summary
    return int(match.group(1)) << 20


def test_the_directory_budget_bounds_what_the_object_store_pins(serve_instance: str) -> None:
    """A long randomized run of publishes (runs of blocks as one object each) and lookups (which
    keep some entries alive): the object store never holds more of the directory's objects than
    its byte budget, as Ray's own object store stats count them."""
    capacity = 8 << 20
    actor = KVDirectory.remote(capacity_bytes=capacity, owner_timeout_s=3600.0)
    layout = BlockLayout("float32", (1,))
    rng = random.Random(21)
    base = _plasma_bytes()
    published: list[int] = []
    try:
        for step in range(160):
            n = rng.randrange(1, 9)
            block = rng.choice((64 << 10, 128 << 10, 256 << 10))
            hashes = [rng.getrandbits(128) for _ in range(n)]
            ref = ray.put(np.zeros(n * block, dtype=np.uint8))
            ray.get(actor.publish.remote("owner", hashes, [ref], block, layout))
            del ref  # the directory's reference is now the only one
            published.extend(hashes)
            if rng.random() < 0.5:
                # Keep a few old blocks in use: under LRU they outlive their neighbours.
                ray.get(actor.lookup.remote([rng.choice(published)]))
            if step % 20 == 19:
                used = ray.get(actor.stats.remote())["used_bytes"]
                assert used <= capacity
                # Freed objects leave the store shortly after their last reference goes.
                deadline = time.monotonic() + 10
                while (pinned := _plasma_bytes() - base) > capacity + (1 << 20):
                    assert time.monotonic() < deadline, (pinned, used)
                    time.sleep(0.2)
    finally:
        ray.kill(actor)
