"""Model shapes for the GPU benchmark, random-weight checkpoints of them, and the decode-step
floor they imply (pure arithmetic: imports and runs on CPU).

A decode step reads every weight the step multiplies by once (the LM head included; an untied
input embedding is only gathered, a few rows, and is left out) and the KV of every context token
of every running sequence, in every layer. Its memory floor is those bytes over the GPU's memory
bandwidth; its launch floor is the number of kernels it runs times the cost of one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Shape:
    """The dimensions of a Llama-architecture model (a real model's, or a tiny one for tests)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Parameters, as transformers' ``LlamaForCausalLM`` has them (no biases)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * (attn + mlp + norms) + h + embed + head

    def params_read_per_step(self) -> int:
        """Parameters a decode step reads in full: all but an untied input embedding."""
        untied_embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params() - untied_embed

    def kv_bytes_per_token(self, dtype: str) -> int:
        """KV bytes one context token holds over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


# Shapes of real models (from their config.json); the weights are random.
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True, 100000.0),
    "smollm2-360m": Shape(960, 32, 15, 5, 2560, 49152, True, 100000.0),
    "qwen2.5-0.5b-like": Shape(896, 24, 14, 2, 4864, 151936, True, 1000000.0),
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 128256, True, 500000.0),
    # For tests on CPU: seconds to build and run.
    "tiny": Shape(64, 2, 4, 2, 128, 512, False, 10000.0, 4096),
}


def llama_config(shape: Shape) -> LlamaConfig:
    """transformers' ``LlamaConfig`` of ``shape``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_theta=shape.rope_theta,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_checkpoint(shape: Shape, path: Path, dtype: str, device: str = "cpu") -> Path:
    """Save a random-weight Llama checkpoint of ``shape`` (config.json + safetensors, no
    tokenizer) to ``path``; weights are drawn on ``device`` (fast on a GPU) with transformers'
    own initialisation, saved in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(shape), dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    return path


@dataclass(frozen=True)
class StepFloor:
    """The least time a decode step can take: memory (weights + KV read at full bandwidth) and
    kernel launches, in milliseconds."""

    weight_bytes: int
    kv_bytes: int
    memory_ms: float
    launch_ms: float | None

    @property
    def total_ms(self) -> float:
        return self.memory_ms + (self.launch_ms or 0.0)


def mean_context_lengths(prompt_lens: list[int], max_tokens: int) -> list[float]:
    """Each sequence's context length averaged over its decode steps: a step that samples
    output token ``t`` (``1 <= t < max_tokens``) attends over ``prompt + t`` tokens."""
    return [p + max_tokens / 2 for p in prompt_lens]


def decode_step_floor(
    shape: Shape,
    dtype: str,
    context_lens: list[float],
    bandwidth_gbps: float,
    kernels_per_step: int | None = None,
    launch_us: float | None = None,
) -> StepFloor:
    """The floor of one decode step of the batch whose sequences hold ``context_lens`` tokens:
    ``(weight bytes + sum(context) x kv bytes per token) / bandwidth``, plus ``kernels x launch
    cost`` where both are known."""
    weight_bytes = shape.params_read_per_step() * DTYPE_BYTES[dtype]
    kv_bytes = int(sum(context_lens) * shape.kv_bytes_per_token(dtype))
    memory_ms = (weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9) * 1e3
    launch_ms = None
    if kernels_per_step is not None and launch_us is not None:
        launch_ms = kernels_per_step * launch_us / 1e3
    return StepFloor(weight_bytes, kv_bytes, memory_ms, launch_ms)
