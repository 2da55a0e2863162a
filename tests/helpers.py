"""Shared test helpers: tiny random checkpoints made on the fly, a mixed engine step, and
Python run in a child."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def make_tiny_llama(
    path: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    model_type: str = "llama",
    perturb_norms: bool = False,
    **extra: object,
) -> Path:
    """Save a random Llama-family checkpoint (config.json + safetensors) to ``path``.

    Weights are drawn with a large init range so that logits are well separated: greedy decoding
    then does not hinge on float rounding differences between implementations. Biases (which
    transformers initialises to zero) are drawn too, so that a model that ignores them differs;
    with ``perturb_norms`` so are norm weights (initialised to one, or to zero where the norm
    scales by 1 + w). ``model_type`` may name any family the engine supports.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif perturb_norms and "norm" in name:
                # Norm weights start at 1 (or 0 where the norm scales by 1 + w): move them, so
                # that a model that skips or misplaces a norm differs.
                param.add_(torch.randn_like(param), alpha=0.2)
    model.save_pretrained(path)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **generate_kwargs: object,
) -> list[list[int]]:
    """Reference greedy continuations from transformers, one prompt at a time (no padding);
    ``generate_kwargs`` go to ``generate`` (logits processors such as ``repetition_penalty``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **generate_kwargs,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


# Tiny configs of Llama 3.x and the families beyond Llama, shaped like the real ones where it matters: Qwen3's
# head_dim differs from hidden / heads; Phi-4-mini rotates 3/4 of each head with longrope;
# Gemma's windows (16) are shorter than the prompts, and Gemma 3's global layers scale RoPE.
TINY_FAMILIES: dict[str, dict[str, object]] = {
    # Llama 3.x's RoPE scaling, with prompts that run past its original length (128).
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
    "phi3": {"model_type": "phi3"},
    "phi4-mini": {
        "model_type": "phi3",
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "original_max_position_embeddings": 64,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 3.0],
            "long_factor": [1.0, 1.5, 2.0, 4.0, 6.0, 9.0],
        },
    },
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 16,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
}


def make_tiny_family(path: Path, family: str, seed: int = 3, **overrides: object) -> Path:
    """A tiny random checkpoint of one of ``TINY_FAMILIES``."""
    return make_tiny_llama(
        path, seed=seed, perturb_norms=True, **{**TINY_FAMILIES[family], **overrides}
    )


def run_python(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (for process-wide settings a test must not leave in
    its own process); its stdout, stripped. Fails the test, with the child's stderr, if it does."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def decodes_and_a_chunk(llm: Any) -> Any:
    """The prepared inputs (``ModelRunner.prepare``'s batch) of a step of three decodes plus a
    9-token prompt chunk, scheduled but not run: after three steps of greedy prompts of 5, 17 and
    40 tokens, a late prompt joins them."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 17, 40)):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 1 for j in range(n)], params)
    for _ in range(3):
        engine.step()
    engine.add_request("late", list(range(3, 12)), params)
    return next_batch(llm)


def next_batch(llm: Any) -> Any:
    """The prepared inputs of the engine's next step, scheduled but not run."""
    from engine.model_runner import ScheduledSeq

    engine = llm.engine
    out = engine.scheduler.schedule()
    seqs = [ScheduledSeq(r, n, engine.kv.block_ids(r.request_id)) for r, n in out.scheduled]
    return engine.runner.prepare(seqs)
