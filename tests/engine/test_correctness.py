"""Greedy output must be token-identical to Hugging Face transformers on the same weights."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.helpers import hf_greedy

MAX_NEW = 24
LENGTHS = [1, 5, 16, 17, 33, 64, 100, 150, 200]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts) -> list[list[int]]:
    return hf_greedy(tiny_llama, prompts, MAX_NEW)


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill"),
        pytest.param({"block_size": 4, "num_kv_blocks": 64}, id="preemption"),
        pytest.param({"max_num_seqs": 3}, id="few-seqs"),
        pytest.param({"scheduling_policy": "priority"}, id="priority"),
    ],
)
def test_greedy_matches_transformers(tiny_llama, prompts, reference, options):
    llm = LLM(model=str(tiny_llama), dtype="float32", **options)
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions_total > 0, "pool should force preemption"
    if "max_num_batched_tokens" in options:
        assert llm.engine.stats.num_steps > len(prompts)
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_shared_prefixes_hit_cache_and_match(tiny_llama):
    rng = random.Random(1)
    system = [rng.randrange(3, 512) for _ in range(70)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 20, 41, 9)]
    reference = hf_greedy(tiny_llama, prompts, MAX_NEW)
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8)
    first = llm.generate(prompts[:1], greedy())
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(prompts[1:], greedy())
    assert [o.token_ids for o in first + rest] == reference
    # 70 shared tokens = 8 full blocks of 8 tokens.
    assert all(o.num_cached_tokens == 64 for o in rest)
    # Same prompt again: everything but the last token comes from the cache.
    again = llm.generate(prompts[:1], greedy())
    assert again[0].token_ids == reference[0]
    assert again[0].num_cached_tokens == (len(prompts[0]) - 1) // 8 * 8


def test_chunked_prefill_after_cache_hit(tiny_llama):
    """A prefix hit followed by a prefill split across steps: the bottom-right causal mask."""
    rng = random.Random(2)
    base = [rng.randrange(3, 512) for _ in range(120)]
    prompts = [base, base[:50] + [rng.randrange(3, 512) for _ in range(90)]]
    reference = hf_greedy(tiny_llama, prompts, 8)
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=16, max_num_batched_tokens=20)
    outs = [llm.generate([p], greedy(8))[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    assert outs[1].num_cached_tokens == 48
