"""Greedy output must be token-identical to Hugging Face transformers on the same weights."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.helpers import hf_greedy, make_tiny_llama

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
    # min_tokens forbids EOS, as the reference's min_new_tokens does.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens)


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
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256)
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
    llm = LLM(
        model=str(tiny_llama),
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=20,
        num_kv_blocks=64,
    )
    outs = [llm.generate([p], greedy(8))[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    assert outs[1].num_cached_tokens == 48


ARCHITECTURES = {
    "tied-embeddings": {"tie_word_embeddings": True},
    "qwen2-qkv-bias": {"model_type": "qwen2"},
    "llama-all-biases": {"attention_bias": True, "mlp_bias": True},
    "rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    },
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architecture_variants_match_transformers(arch, prompts, tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp(arch), seed=3, **ARCHITECTURES[arch])
    reference = hf_greedy(model_dir, prompts, MAX_NEW)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256)
    cfg = llm.engine.model_cfg
    assert cfg.model_type == ARCHITECTURES[arch].get("model_type", "llama")
    assert cfg.tie_word_embeddings == (arch == "tied-embeddings")
    assert cfg.qkv_bias == (arch in ("qwen2-qkv-bias", "llama-all-biases"))
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == reference


@pytest.mark.slow
def test_smollm2_chat_matches_transformers(smollm2_dir):
    """The default model answers a chat-templated question with transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(model="smollm2-135m-instruct", dtype="float32", num_kv_blocks=64)
    assert llm.engine.model_dir == smollm2_dir
    tok = llm.get_tokenizer()
    messages = [
        {"role": "user", "content": "Write a short story about a robot who learns to paint."}
    ]
    prompt = list(
        tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False
        )
    reference = gen[0, len(prompt) :].tolist()
    assert len(reference) == 40  # a story does not end within 40 tokens

    out = llm.chat(messages, SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.prompt_token_ids == prompt
    assert out.token_ids == reference
    assert out.text == tok.decode(reference, skip_special_tokens=True)
    assert out.finish_reason == "length"


def test_repetition_penalty_matches_transformers(tiny_llama, prompts, reference):
    """transformers' RepetitionPenaltyLogitsProcessor is the reference: prompt and output tokens
    are penalized. Plain greedy requests share the batch and stay as they were."""
    penalized = hf_greedy(tiny_llama, prompts, MAX_NEW, repetition_penalty=1.8)
    assert penalized != reference, "the penalty should change some continuation"
    llm = LLM(model=str(tiny_llama), dtype="float32")
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, min_tokens=MAX_NEW, repetition_penalty=1.8
    )
    outs = llm.generate(prompts + prompts, [params] * len(prompts) + [greedy()] * len(prompts))
    assert [o.token_ids for o in outs] == penalized + reference
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_logit_bias_matches_transformers(tiny_llama, prompts, reference):
    """logit_bias adds to the logits as transformers' sequence_bias does for one-token
    sequences: the reference's favourite tokens pushed down, another pushed up."""
    counts: dict[int, int] = {}
    for tokens in reference:
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
    favourites = sorted(counts, key=counts.__getitem__, reverse=True)[:3]
    bias = {favourites[0]: -100.0, favourites[1]: -4.0, favourites[2]: 2.5, 7: 3.0}
    biased = hf_greedy(
        tiny_llama, prompts, MAX_NEW, sequence_bias={(t,): b for t, b in bias.items()}
    )
    assert biased != reference
    assert all(favourites[0] not in tokens for tokens in biased)
    llm = LLM(model=str(tiny_llama), dtype="float32")
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, min_tokens=MAX_NEW, logit_bias=bias
    )
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == biased


def test_allowed_token_ids_match_transformers(tiny_llama, prompts, reference):
    """vLLM's allowed_token_ids does what transformers' prefix_allowed_tokens_fn does with a fixed
    set: only those tokens are picked. Greedy requests without one share the batch unchanged, and
    sampled ones stay within the set too."""
    picked = sorted({t for tokens in reference for t in tokens})
    allowed = picked[1::2] + [7, 11]  # half of what greedy picks, and two others
    constrained = hf_greedy(
        tiny_llama, prompts, MAX_NEW, prefix_allowed_tokens_fn=lambda batch, ids: allowed
    )
    assert constrained != reference
    assert all(t in allowed for tokens in constrained for t in tokens)
    llm = LLM(model=str(tiny_llama), dtype="float32")
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, min_tokens=MAX_NEW, allowed_token_ids=allowed
    )
    outs = llm.generate(prompts + prompts, [params] * len(prompts) + [greedy()] * len(prompts))
    assert [o.token_ids for o in outs] == constrained + reference
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=5, allowed_token_ids=allowed)
    for out in llm.generate(prompts, sampled):
        assert out.token_ids and set(out.token_ids) <= set(allowed)
