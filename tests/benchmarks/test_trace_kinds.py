"""The multi-turn and many-tenant trace mixes: Mooncake's format, the sharing each one promises,
seeded, and readable by the simulator."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import trace_kinds
from benchmarks.make_trace import BLOCK_TOKENS, trace_stats
from benchmarks.sim.trace import load_trace
from benchmarks.trace_kinds import conversation_trace, tenant_trace


def _check_format(records: list[dict]) -> None:
    assert all(
        list(r) == ["timestamp", "input_length", "output_length", "hash_ids"] for r in records
    )
    times = [r["timestamp"] for r in records]
    assert times[0] == 0 and times == sorted(times)
    seen = -1
    for r in records:
        ids = r["hash_ids"]
        assert (len(ids) - 1) * BLOCK_TOKENS < r["input_length"] <= len(ids) * BLOCK_TOKENS
        assert r["output_length"] >= 1 and len(set(ids)) == len(ids)
        new = [h for h in ids if h > seen]
        assert new == list(range(seen + 1, seen + 1 + len(new)))
        seen = max(seen, *ids)


def test_conversation_turns_extend_the_previous_turn() -> None:
    records = conversation_trace(1500, seed=2)
    assert len(records) == 1500
    _check_format(records)
    # Index every prompt's full-block prefix; each prompt longer than a first turn can be
    # (4,096 tokens) must extend an earlier, shorter prompt by all of its full blocks.
    earlier: dict[tuple[int, ...], int] = {}
    follow_ups = 0
    for r in records:
        ids, length = r["hash_ids"], r["input_length"]
        if length > 4096:
            follow_ups += 1
            assert any(
                tuple(ids[:k]) in earlier and earlier[tuple(ids[:k])] < length
                for k in range(1, len(ids))
            ), r
        earlier.setdefault(tuple(ids[: length // BLOCK_TOKENS]), length)
    assert follow_ups > 100
    stats = trace_stats(records)
    assert 0.4 < stats["infinite_cache_hit_ratio"] < 0.9
    assert 2.5 < stats["rate"] < 4.5  # about the Mooncake trace's 3.9 req/s


def test_tenants_share_long_system_prompts_with_zipf_popularity() -> None:
    records = tenant_trace(3000, seed=1, num_tenants=150, zipf_s=1.0)
    _check_format(records)
    # The system prompt is every full block but the question's: whole 512-token blocks.
    question_blocks = [
        -(-(r["input_length"] % BLOCK_TOKENS or BLOCK_TOKENS) // BLOCK_TOKENS) for r in records
    ]
    systems = Counter(
        tuple(r["hash_ids"][: len(r["hash_ids"]) - q])
        for r, q in zip(records, question_blocks, strict=True)
    )
    assert len(systems) <= 150
    assert all(2 <= len(s) <= 16 for s in systems)
    shares = sorted(systems.values(), reverse=True)
    harmonic = sum(1 / k for k in range(1, 151))
    assert shares[0] / 3000 == pytest.approx(1 / harmonic, rel=0.2)  # Zipf: rank 1 gets 1/H
    assert shares[0] > 5 * shares[20]
    assert trace_stats(records)["infinite_cache_hit_ratio"] > 0.7


def test_seeded_and_readable_by_the_simulator(tmp_path: Path) -> None:
    assert tenant_trace(200, seed=4) == tenant_trace(200, seed=4) != tenant_trace(200, seed=5)
    assert conversation_trace(200, seed=4) == conversation_trace(200, seed=4)
    out = tmp_path / "conv.jsonl"
    assert (
        trace_kinds.main(["--kind", "conversation", "--num-requests", "300", "--out", str(out)])
        == 0
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == conversation_trace(300)
    specs = load_trace(out, block_tokens=16)
    assert len(specs) == 300
    with pytest.raises(ValueError, match="num_tenants"):
        tenant_trace(10, num_tenants=0)
