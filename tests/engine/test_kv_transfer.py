"""Exporting and importing prefix KV blocks between two engines."""

from __future__ import annotations

import random

import torch

from deployments.kv_sharing import from_numpy, to_numpy
from engine import LLM, SamplingParams
from engine.kv_transfer import export_blocks, import_blocks


def test_imported_prefix_is_hit_and_output_unchanged(tiny_llama) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(3, 512) for _ in range(100)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kwargs = dict(dtype="float32", block_size=16, num_kv_blocks=64)
    a, b = LLM(model=str(tiny_llama), **kwargs), LLM(model=str(tiny_llama), **kwargs)

    cold = a.generate([prompt], params)[0]
    request = a.engine.make_request("probe", prompt, params)
    found, kv = export_blocks(a.engine, request.block_hashes)
    assert found == request.block_hashes[:6] and kv.shape[0] == 6  # 100 tokens = 6 full blocks

    free_before = b.engine.kv.pool.num_free_blocks
    assert import_blocks(b.engine, found, kv) == (6, 6)
    assert import_blocks(b.engine, found, kv) == (6, 0)  # idempotent
    # Installed blocks are free but cached: nothing is held.
    assert b.engine.kv.pool.num_free_blocks == free_before
    b.engine.kv.pool.check_invariants()

    warm = b.generate([prompt], params)[0]
    assert warm.num_cached_tokens == 96
    assert warm.token_ids == cold.token_ids


def test_import_refuses_when_pool_is_too_small(tiny_llama) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=16, num_kv_blocks=4)
    kv = torch.zeros(6, 2, 2, 16, 2, 16)
    assert import_blocks(llm.engine, [1, 2, 3, 4, 5, 6], kv) == (0, 0)
    assert llm.engine.kv.pool.num_free_blocks == 4


def test_numpy_round_trip_keeps_bfloat16_bits() -> None:
    x = torch.randn(3, 4, 5).to(torch.bfloat16)
    arr = to_numpy(x)
    assert arr.dtype.itemsize == 2
    assert torch.equal(from_numpy(arr, torch.bfloat16), x)
    y = torch.randn(2, 3)
    assert torch.equal(from_numpy(to_numpy(y), torch.float32), y)
