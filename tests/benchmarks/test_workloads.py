"""Workload generators: lengths, determinism, real sharing, trace scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.workloads import (
    hash_id_block,
    hash_id_blocks,
    random_requests,
    safe_id_range,
    scale_trace_record,
    shared_prefix_requests,
    trace_requests,
)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_random_lengths_ids_and_determinism() -> None:
    reqs = random_requests(
        200, input_len_min=5, input_len_max=9, output_len=7, vocab_size=1000, seed=3
    )
    assert len(reqs) == 200
    low, high = safe_id_range(1000)
    assert (low, high) == (100, 900)
    assert {r.prompt_len for r in reqs} == set(range(5, 10))
    assert all(r.output_len == 7 and r.shared_prefix_len == 0 for r in reqs)
    assert all(low <= t < high for r in reqs for t in r.prompt_token_ids)
    assert reqs == random_requests(
        200, input_len_min=5, input_len_max=9, output_len=7, vocab_size=1000, seed=3
    )
    other = random_requests(
        200, input_len_min=5, input_len_max=9, output_len=7, vocab_size=1000, seed=4
    )
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_random_prompts_never_share_a_first_block() -> None:
    # A vocabulary of 3 safe ids and 2-token "blocks": 9 possible first blocks for 9 prompts, so
    # duplicates are certain unless the generator resamples them away.
    reqs = random_requests(
        9, input_len_min=2, input_len_max=4, vocab_size=203, distinct_prefix_len=2
    )
    firsts = [tuple(r.prompt_token_ids[:2]) for r in reqs]
    assert len(set(firsts)) == 9


@pytest.mark.parametrize("order", ["grouped", "interleaved", "random"])
def test_shared_prefix_groups(order: str) -> None:
    reqs = shared_prefix_requests(
        num_groups=3, prompts_per_group=4, prefix_len=20, question_len=6, output_len=5,
        arrival_order=order, vocab_size=500, seed=1,
    )  # fmt: skip
    assert len(reqs) == 12
    assert all(r.prompt_len == 26 and r.shared_prefix_len == 20 and r.output_len == 5 for r in reqs)
    by_group: dict[int, list[list[int]]] = {}
    for r in reqs:
        assert r.group is not None
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 4 for v in by_group.values())
    for g, prompts in by_group.items():
        # Within a group the shared part is exactly the prefix; across groups nothing is shared.
        assert len({tuple(p[:20]) for p in prompts}) == 1
        assert len({tuple(p[20:]) for p in prompts}) == 4
        assert all(_common_prefix(a, b) == 20 for a in prompts for b in prompts if a is not b)
        for h, others in by_group.items():
            if h != g:
                assert _common_prefix(prompts[0], others[0]) == 0
    groups = [r.group for r in reqs]
    if order == "grouped":
        assert groups == [0] * 4 + [1] * 4 + [2] * 4
    elif order == "interleaved":
        assert groups == [0, 1, 2] * 4
    else:
        assert groups != [0] * 4 + [1] * 4 + [2] * 4 and groups != [0, 1, 2] * 4
    again = shared_prefix_requests(
        num_groups=3, prompts_per_group=4, prefix_len=20, question_len=6, output_len=5,
        arrival_order=order, vocab_size=500, seed=1,
    )  # fmt: skip
    assert again == reqs


def test_hash_id_block_is_a_pure_function() -> None:
    a = hash_id_block(42, 32, vocab_size=1000)
    assert a == hash_id_block(42, 32, vocab_size=1000)
    assert len(a) == 32 and all(100 <= t < 900 for t in a)
    assert hash_id_block(42, 8, vocab_size=1000) == a[:8]
    assert hash_id_block(43, 32, vocab_size=1000) != a
    assert hash_id_block(42, 32, vocab_size=1000, seed=1) != a
    assert len(set(a)) > 16  # not degenerate
    rows = hash_id_blocks([43, 42, 43], 32, vocab_size=1000).tolist()
    assert rows == [
        hash_id_block(43, 32, vocab_size=1000),
        a,
        hash_id_block(43, 32, vocab_size=1000),
    ]


def _write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TRACE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 700, "output_length": 300, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
    {"timestamp": 2500, "input_length": 3, "output_length": 50, "hash_ids": [4]},
]


def test_trace_scaling(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", TRACE)
    reqs = trace_requests(
        path, block_tokens=16, output_scale=0.5, max_output_len=100, time_scale=0.1
    )
    assert len(reqs) == 4
    # Input 1100 = 2 full 512-blocks + 76 tokens -> 2 * 16 + ceil(76 * 16 / 512) = 35 tokens.
    assert [r.prompt_len for r in reqs] == [35, 22, 32, 1]
    assert [r.output_len for r in reqs] == [5, 100, 1, 25]
    assert [r.arrival_time for r in reqs] == pytest.approx([0.0, 0.05, 0.15, 0.25])
    assert [r.hash_ids for r in reqs] == [(0, 1, 2), (0, 3), (0, 1), (4,)]
    block = {h: hash_id_block(h, 16) for h in range(5)}
    for rec, req in zip(TRACE, reqs, strict=True):
        expected = [t for h in rec["hash_ids"] for t in block[h]][: req.prompt_len]
        assert req.prompt_token_ids == expected
    # Equal hash ids give equal tokens across requests: requests 0 and 2 share blocks 0 and 1.
    assert reqs[0].prompt_token_ids[:32] == reqs[2].prompt_token_ids
    shared = _common_prefix(reqs[0].prompt_token_ids, reqs[1].prompt_token_ids)
    assert shared == 16 + _common_prefix(block[1], block[3])


def test_trace_limit_caps_and_block_size(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", TRACE)
    reqs = trace_requests(path, block_tokens=32, limit=2, max_input_len=40, time_scale=2.0)
    assert len(reqs) == 2
    assert [r.prompt_len for r in reqs] == [40, 40]
    assert [r.hash_ids for r in reqs] == [(0, 1), (0, 3)]
    assert [r.arrival_time for r in reqs] == [0.0, 1.0]
    assert [r.output_len for r in reqs] == [10, 128]  # default cap
    assert reqs[0].prompt_token_ids[:32] == hash_id_block(0, 32)


@settings(max_examples=100, deadline=None)
@given(
    input_length=st.integers(1, 200_000),
    block_tokens=st.sampled_from([1, 8, 16, 32, 512]),
)
def test_scaled_length_keeps_every_block(input_length: int, block_tokens: int) -> None:
    n = math.ceil(input_length / 512)
    record = {
        "timestamp": 0,
        "input_length": input_length,
        "output_length": 1,
        "hash_ids": list(range(n)),
    }
    req = scale_trace_record(record, block_tokens=block_tokens)
    assert (n - 1) * block_tokens < req.prompt_len <= n * block_tokens
    assert req.hash_ids == tuple(range(n))
    if block_tokens == 512:
        assert req.prompt_len == input_length
