"""Prompt logprobs: every prompt token's log-probability given the tokens before it, checked
against transformers' logits on the same weights, however the prompt was chunked, preempted or
cached."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.helpers import random_tokens

TOP = 3
LENGTHS = [1, 2, 17, 40, 90]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_tokens(n, seed=100 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts) -> list[torch.Tensor]:
    """Per prompt, ``log_softmax`` of transformers' logits: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts
        ]


def params(max_tokens: int = 2, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=TOP, **kw)


def check(prompt: list[int], got: list, ref: torch.Tensor) -> None:
    assert len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        assert entry.token_id == prompt[i]
        assert math.isclose(entry.logprob, float(ref[i - 1, prompt[i]]), abs_tol=1e-4)
        top_vals, top_ids = ref[i - 1].topk(TOP)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_vals.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="one-pass"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
        pytest.param(
            {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 64}, id="preemption"
        ),
    ],
)
def test_prompt_logprobs_match_transformers(tiny_llama, prompts, reference, options):
    llm = LLM(model=str(tiny_llama), dtype="float32", **options)
    # 16 tokens out each: in the small pool, decodes preempt requests whose prompts were scored.
    outs = llm.generate(prompts, params(max_tokens=16, min_tokens=16))
    for prompt, out, ref in zip(prompts, outs, reference, strict=True):
        check(prompt, out.prompt_logprobs, ref)
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions_total > 0, "pool should force preemption"
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_cached_prefix_is_computed_again_and_still_published(tiny_llama, prompts, reference):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=128)
    prompt, ref = prompts[-1], reference[-1]
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([prompt], plain)
    # The prompt's blocks are cached, but cached KV has no logits: computed again.
    [out] = llm.generate([prompt], params())
    assert out.num_cached_tokens == 0
    check(prompt, out.prompt_logprobs, ref)
    # ... while a plain request still finds them.
    [again] = llm.generate([prompt], plain)
    assert again.num_cached_tokens == (len(prompt) - 1) // 8 * 8


def test_only_asked_for_and_zero_means_the_token_alone(tiny_llama, prompts, reference):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    plain, zero = llm.generate(
        [prompts[2]] * 2,
        [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=0)],
    )
    assert plain.prompt_logprobs is None
    assert all(e.top == [] for e in zero.prompt_logprobs[1:])
    assert zero.prompt_logprobs[5].logprob == pytest.approx(
        float(reference[2][4, prompts[2][5]]), abs=1e-4
    )


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
