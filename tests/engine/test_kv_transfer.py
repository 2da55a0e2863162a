"""Prefix KV between engines: export, import through the KV connector, and refusal of KV that
was computed under another dtype or other weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deployments.kv_sharing import from_numpy, to_numpy
from engine import LLM, SamplingParams
from engine.kv_connector import KVBlocks, KVConnector
from engine.kv_transfer import KVLayoutError, import_blocks
from engine.request import Request
from tests.helpers import make_tiny_llama

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
KWARGS = dict(block_size=16, num_kv_blocks=64)


class Supplier(KVConnector):
    """Hands every added request the given blocks and records what the engine said."""

    def __init__(self, blocks: KVBlocks | None) -> None:
        self.blocks = blocks
        self.outcomes: list[tuple[int, str | None]] = []
        self.computed: list[str] = []

    def load(self, request: Request, num_local_blocks: int) -> KVBlocks | None:
        return self.blocks if num_local_blocks == 0 else None

    def loaded(self, request: Request, num_installed: int, rejected: str | None) -> None:
        self.outcomes.append((num_installed, rejected))

    def on_prompt_computed(self, request: Request) -> None:
        self.computed.append(request.request_id)


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _exported(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    request = llm.engine.make_request("probe", prompt, PARAMS)
    return llm.engine.export_prefix(request.block_hashes)


def test_imported_prefix_is_hit_and_output_unchanged(tiny_llama) -> None:
    prompt = _prompt(3)
    a = LLM(model=str(tiny_llama), dtype="float32", **KWARGS)
    b = LLM(model=str(tiny_llama), dtype="float32", **KWARGS)
    assert a.engine.kv_namespace == b.engine.kv_namespace

    cold = a.generate([prompt], PARAMS)[0]
    found, kv = _exported(a, prompt)
    assert len(found) == 6 and kv.shape[0] == 6  # 100 tokens = 6 full blocks

    supplier = Supplier(KVBlocks(found, [from_numpy(to_numpy(kv), torch.float32)]))
    b.engine.kv_connector = supplier
    free_before = b.engine.kv.pool.num_free_blocks
    warm = b.generate([prompt], PARAMS)[0]
    assert supplier.outcomes == [(6, None)]
    assert supplier.computed == [warm.request_id]
    assert warm.num_cached_tokens == 96
    assert warm.token_ids == cold.token_ids
    assert b.engine.kv.pool.num_free_blocks == free_before
    b.engine.kv.pool.check_invariants()


def test_import_refuses_when_pool_is_too_small(tiny_llama) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=16, num_kv_blocks=4)
    kv = torch.zeros(6, *llm.engine.kv_block_shape)
    assert import_blocks(llm.engine.kv, llm.engine.runner, [1, 2, 3, 4, 5, 6], kv) == (0, 0)
    assert llm.engine.kv.pool.num_free_blocks == 4


def test_import_never_evicts_the_runs_own_cached_blocks(tiny_llama) -> None:
    # The run's two leading blocks are cached here and first in the free queue, so allocating
    # room for the other four would evict them were they not held meanwhile.
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=16, num_kv_blocks=8)
    pool = llm.engine.kv.pool
    blocks = pool.allocate(8)
    for block, h in zip(blocks[:2], (101, 102), strict=True):
        pool.cache_block(block, h)
    pool.free(blocks)
    kv = torch.zeros(6, *llm.engine.kv_block_shape)
    hashes = [101, 102, 103, 104, 105, 106]
    assert import_blocks(llm.engine.kv, llm.engine.runner, hashes, kv) == (6, 4)
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


@pytest.mark.parametrize(("source", "target"), [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_kv_of_another_dtype_is_never_used(tiny_llama, source: str, target: str) -> None:
    prompt = _prompt(4)
    src = LLM(model=str(tiny_llama), dtype=source, **KWARGS)
    dst = LLM(model=str(tiny_llama), dtype=target, **KWARGS)
    # Another dtype is another namespace: no block hash is shared ...
    assert src.engine.kv_namespace != dst.engine.kv_namespace
    src.generate([prompt], PARAMS)
    src_hashes = src.engine.make_request("p", prompt, PARAMS).block_hashes
    dst_hashes = dst.engine.make_request("p", prompt, PARAMS).block_hashes
    assert not set(src_hashes) & set(dst_hashes)

    # ... and even offered under the importer's own hashes, the data is refused before any
    # block is allocated: the output is the cold run's and every block is free again.
    cold = LLM(model=str(tiny_llama), dtype=target, **KWARGS).generate([prompt], PARAMS)[0]
    _, kv = _exported(src, prompt)
    foreign = from_numpy(to_numpy(kv), getattr(torch, source))
    supplier = Supplier(KVBlocks(dst_hashes[: kv.shape[0]], [foreign]))
    dst.engine.kv_connector = supplier
    out = dst.generate([prompt], PARAMS)[0]
    (installed, reason), *_ = supplier.outcomes
    assert installed == 0 and "dtype" in reason
    assert out.num_cached_tokens == 0
    assert out.token_ids == cold.token_ids
    pool = dst.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_layout_check_names_the_mismatch(tiny_llama) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32", **KWARGS)
    shape = llm.engine.kv_block_shape
    wrong = torch.zeros(2, shape[0], shape[1], shape[2], shape[3] + 1, shape[4])
    with pytest.raises(KVLayoutError, match="block shape"):
        import_blocks(llm.engine.kv, llm.engine.runner, [1, 2], wrong)
    with pytest.raises(KVLayoutError, match="hashes name"):
        import_blocks(llm.engine.kv, llm.engine.runner, [1], torch.zeros(2, *shape))
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_changed_weights_under_the_same_name_change_the_namespace(tmp_path: Path) -> None:
    a = make_tiny_llama(tmp_path / "a", seed=1)
    b = make_tiny_llama(tmp_path / "b", seed=2)
    ea = LLM(model=str(a), dtype="float32", hash_salt="same-name", **KWARGS).engine
    eb = LLM(model=str(b), dtype="float32", hash_salt="same-name", **KWARGS).engine
    again = LLM(model=str(a), dtype="float32", hash_salt="same-name", **KWARGS).engine
    assert ea.kv_namespace != eb.kv_namespace
    assert ea.kv_namespace == again.kv_namespace
    prompt = _prompt(5)
    assert not set(ea.make_request("x", prompt).block_hashes) & set(
        eb.make_request("x", prompt).block_hashes
    )


def test_numpy_round_trip_keeps_bfloat16_bits() -> None:
    x = torch.randn(3, 4, 5).to(torch.bfloat16)
    arr = to_numpy(x)
    assert arr.dtype.itemsize == 2
    assert torch.equal(from_numpy(arr, torch.bfloat16), x)
    y = torch.randn(2, 3)
    assert torch.equal(from_numpy(to_numpy(y), torch.float32), y)
