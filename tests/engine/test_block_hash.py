"""Chained block hashes: deterministic across processes, namespaced, keyed, chained, 128-bit,
full blocks only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_hash import (
    compute_block_hashes,
    extend_block_hashes,
    hash_block_tokens,
    hash_key,
    hash_root,
)

TOKENS = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 and a partial one


def test_only_full_blocks_are_hashed():
    assert len(compute_block_hashes(TOKENS, 16)) == 2
    assert compute_block_hashes(TOKENS[:15], 16) == []
    assert len(compute_block_hashes(TOKENS[:32], 16)) == 2


def test_hashes_are_chained():
    hashes = compute_block_hashes(TOKENS, 8, hash_root("m"))
    assert hashes[0] == hash_block_tokens(None, TOKENS[:8], hash_root("m"))
    assert hashes[1] == hash_block_tokens(hashes[0], TOKENS[8:16], hash_root("m"))
    # Changing a token of block 0 changes the hash of every later block.
    changed = compute_block_hashes([TOKENS[0] + 1, *TOKENS[1:]], 8, hash_root("m"))
    assert all(a != b for a, b in zip(hashes, changed, strict=True))
    # Changing block 2 leaves blocks 0 and 1 alone.
    changed = compute_block_hashes(TOKENS[:16] + [7] + TOKENS[17:], 8, hash_root("m"))
    assert changed[:2] == hashes[:2]
    assert all(a != b for a, b in zip(hashes[2:], changed[2:], strict=True))


def test_same_tokens_at_another_position_hash_differently():
    block = list(range(8))
    hashes = compute_block_hashes(block * 2, 8)
    assert hashes[0] != hashes[1]


def test_namespace_key_and_cache_salt_each_change_every_hash():
    key = hash_key("a secret of the application")
    base = compute_block_hashes(TOKENS, 16, hash_root("ns-a", key))
    for root in (
        hash_root("ns-b", key),
        hash_root("ns-a", hash_key("another secret")),
        hash_root("ns-a"),  # unkeyed
        hash_root("ns-a", key, cache_salt="tenant-1"),
    ):
        other = compute_block_hashes(TOKENS, 16, root)
        assert all(x != y for x, y in zip(base, other, strict=True))
    assert compute_block_hashes(TOKENS, 16, hash_root("ns-a", key)) == base
    assert hash_key(None) == hash_key("") == b""


def test_hashes_are_128_bits():
    hashes = compute_block_hashes(list(range(16 * 64)), 16, hash_root("m"))
    assert all(0 <= h < 1 << 128 for h in hashes)
    # Uniform over 128 bits: some hash uses the top 64 (a 64-bit hash never would).
    assert any(h >> 64 for h in hashes)


def test_extend_matches_full_computation():
    hashes: list[int] = []
    for n in range(1, len(TOKENS) + 1):
        extend_block_hashes(hashes, TOKENS[:n], 4, hash_root("s"))
        assert hashes == compute_block_hashes(TOKENS[:n], 4, hash_root("s"))


def test_large_token_ids_are_hashed_distinctly():
    # u32 packing: ids above 16 bits must not wrap or collide.
    assert hash_block_tokens(None, [70000]) != hash_block_tokens(None, [70000 - 65536])


def test_bad_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes(TOKENS, 0)


def test_deterministic_across_processes():
    """Python's hash() is salted per process; ours must not be (the router relies on it). The
    child loads block_hash.py alone, so that it does not pay for importing torch."""
    path = Path(__file__).resolve().parents[2] / "engine" / "block_hash.py"
    code = (
        "import importlib.util, json\n"
        f"spec = importlib.util.spec_from_file_location('bh', {str(path)!r})\n"
        "bh = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(bh)\n"
        f"print(json.dumps(bh.compute_block_hashes({TOKENS!r}, 8, bh.hash_root('smollm2', b'k'))))\n"
    )
    here = compute_block_hashes(TOKENS, 8, hash_root("smollm2", b"k"))
    for seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(proc.stdout) == here
