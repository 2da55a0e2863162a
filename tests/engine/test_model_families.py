"""Llama 3.x RoPE scaling, Qwen3, Phi-3 / Phi-4-mini, Gemma 2 and Gemma 3: greedy output token-identical to transformers
(float32) on tiny random checkpoints, through chunked prefill and prefix-cache hits, on every
attention backend that applies."""

from __future__ import annotations

import logging
import random
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.kernels import native
from tests.helpers import TINY_FAMILIES, hf_greedy, make_tiny_family

MAX_NEW = 24
LENGTHS = [1, 5, 16, 17, 33, 64, 100, 150]
# (family, checkpoint overrides); Gemma 2's caps are lowered from its defaults (50, 30) to where
# they bend these tiny models' scores and logits.
CASES = {
    "llama3": ("llama3", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi4-mini": ("phi4-mini", {}),
    "gemma2": ("gemma2", {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0}),
    "gemma3": ("gemma3", {}),
}
# The forward each family takes on CPU in float32 with the native kernels built, and whether
# its attention needs the torch backend (sliding windows, soft-capping).
# The forward each family takes in float32 (every model here is served in float32), and whether
# it needs torch's attention: plain Llamas take the one-call native stack where the float32
# linear kernel runs (engine.model.native_forward), else the fused loop.
_PLAIN = "native" if native.f32_linear_preferred() else "fused"
EXPECTED_PATH = {
    "llama3": (_PLAIN, False),
    "qwen3": ("fused", False),
    "phi3": (_PLAIN, False),
    "phi4-mini": ("reference", False),
    "gemma2": ("reference", True),
    "gemma3": ("reference", True),
}


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens)


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(case name, checkpoint directory, prompts, transformers' greedy continuations)."""
    name = request.param
    family, overrides = CASES[name]
    model_dir = make_tiny_family(tmp_path_factory.mktemp(name), family, **overrides)
    # Phi-4-mini's longrope: the engine (max length 1024 > 64) uses the long factors, which the
    # reference picks for a sequence whose prompt is already past 64 positions.
    lengths = [65, 70, 100, 150] if name == "phi4-mini" else LENGTHS
    prompts = random_prompts(0, lengths)
    return name, model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_family_matches_transformers_with_chunks_and_cache_hits(case, backend):
    name, model_dir, prompts, reference = case
    assert all(len(set(r)) > 3 for r in reference), "degenerate reference: test would be weak"
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        attention_backend=backend,
        block_size=8,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
    )
    first = llm.generate(prompts, greedy())
    assert [o.token_ids for o in first] == reference
    assert llm.engine.stats.num_steps > len(prompts)  # prompts were split into chunks
    again = llm.generate(prompts, greedy())
    assert [o.token_ids for o in again] == reference
    for prompt, out in zip(prompts, again, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 8 * 8
    path, needs_torch = EXPECTED_PATH[name]
    if backend == "auto" and native.available():
        assert llm.engine.model.forward_path() == path
        assert llm.engine.runner.backend.name == ("torch" if needs_torch else "cpu")
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_prefix_hit_then_chunks_across_the_window(case):
    """A cached prefix longer than Gemma's window, then a prefill split into chunks shorter
    than the window: each chunk's windowed layers read keys both from the cache and from the
    chunk before."""
    _, model_dir, _, _ = case
    base = random_prompts(5, [120])[0]
    tail = random_prompts(6, [50])[0]
    prompts = [base, base[:70] + tail]
    reference = hf_greedy(model_dir, prompts, 8)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=128,
        max_num_batched_tokens=11,
    )
    outs = [llm.generate([p], greedy(8))[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    assert outs[1].num_cached_tokens == 64


def test_phi4_mini_short_factors_within_the_pretraining_length(tmp_path):
    """An engine that never goes past longrope's pretraining length (64) uses the short
    factors, as the reference does for sequences that stay within it."""
    model_dir = make_tiny_family(tmp_path, "phi4-mini")
    prompts = random_prompts(1, [1, 9, 17, 30, 40])
    reference = hf_greedy(model_dir, prompts, MAX_NEW)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(prompts, greedy())] == reference


def test_prompt_logprobs_match_transformers_logits(case):
    """Every prompt token's logprob and top 3 against log_softmax of transformers' logits: the
    numerics behind greedy order, and Gemma 2's final soft-capping (which keeps the argmax)."""
    import torch
    from transformers import AutoModelForCausalLM

    _, model_dir, _, _ = case
    prompt = random_prompts(7, [90])[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    got = llm.generate([prompt], params)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert got[i].token_id == prompt[i]
        assert got[i].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        top_vals, top_ids = ref[i - 1].topk(3)
        assert [t for t, _ in got[i].top] == top_ids.tolist()
        assert [v for _, v in got[i].top] == pytest.approx(top_vals.tolist(), abs=1e-4)


def test_start_up_logs_the_path_taken(case, caplog):
    name, model_dir, _, _ = case
    path, needs_torch = EXPECTED_PATH[name]
    # Without the native kernels every model takes the reference forward and torch attention.
    fast = native.available()
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16)
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert len(ready) == 1 and f"forward={path if fast else 'reference'}," in ready[0]
    attention = "cpu" if fast and not needs_torch else "torch"
    # CUDA graphs are for decode steps on a GPU only.
    assert f"attention={attention}, decode graphs=off)" in ready[0]
    assert ("takes the torch backend" in caplog.text) == (fast and needs_torch)


@pytest.mark.skipif(not native.available(), reason="the fused path needs the native kernels")
def test_qwen3_fused_path_generates_like_reference_in_bf16(tmp_path):
    """Qwen3's q/k norms inside the fused path (bf16): the first tokens of the reference ops, as
    the Llama fused path's own test checks; the native decode stack does not take q/k norms."""
    model_dir = make_tiny_family(tmp_path, "qwen3")
    prompts = random_prompts(9, [4, 20, 44])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_num_batched_tokens=16)
    model = llm.engine.model
    assert model.native_forward is None and model.forward_path() == "fused"
    fused_out = [o.token_ids for o in llm.generate(prompts, params)]
    model.use_fused = False
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o[:6] for o in fused_out] == [o[:6] for o in reference]


def make_tiny_gemma3_vision_language(path, seed: int = 3):
    """A tiny Gemma 3 vision-language checkpoint (as Gemma 3 4B and up are published): the
    tiny Gemma 3 text decoder beside a one-layer SigLIP tower."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    text = {k: v for k, v in TINY_FAMILIES["gemma3"].items() if k != "model_type"}
    text |= dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = AutoConfig.for_model(
        "gemma3",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param), alpha=0.2)
    model.save_pretrained(path)
    return path


def test_gemma3_vision_language_checkpoint_serves_its_text_decoder(tmp_path):
    """The text decoder of a vision-language Gemma 3 checkpoint, with its weights named as
    published (``language_model.model.*``) or as transformers nests them
    (``model.language_model.*``): transformers' greedy tokens for text prompts."""
    from safetensors.torch import load_file, save_file

    published = make_tiny_gemma3_vision_language(tmp_path / "published")
    prompts = random_prompts(12, [5, 40, 100])
    reference = hf_greedy(published, prompts, 12)
    assert all(len(set(r)) > 3 for r in reference)
    nested = tmp_path / "nested"
    shutil.copytree(published, nested)
    weights = load_file(nested / "model.safetensors")
    renames = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    renamed = {}
    for name, tensor in weights.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    assert any(k.startswith("model.language_model.") for k in renamed)
    save_file(renamed, nested / "model.safetensors", metadata={"format": "pt"})
    for model_dir in (published, nested):
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            block_size=8,
            num_kv_blocks=64,
            max_num_batched_tokens=24,
        )
        assert llm.engine.model_cfg.model_type == "gemma3_text"
        assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == reference


def test_family_matches_transformers_through_preemption(case):
    """A pool too small for the batch: preempted requests recompute (their prefix may hit the
    cache) and still produce the reference's tokens."""
    _, model_dir, prompts, reference = case
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=72,
        max_num_batched_tokens=64,
    )
    assert [o.token_ids for o in llm.generate(prompts, greedy())] == reference
    assert llm.engine.scheduler.num_preemptions_total > 0, "pool should force preemption"
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
