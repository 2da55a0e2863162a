"""The architecture facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose frequencies do not depend on the sequence being processed.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rope_type: str
    eos_token_ids: frozenset[int]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


def _rope_parameters(hf_config: Any) -> dict:
    """transformers 5 writes ``rope_parameters``; older configs have ``rope_theta`` and
    ``rope_scaling``. Read both."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, list | tuple | set):
        return {int(v) for v in value}
    return {int(value)}


def model_config_from_hf(hf_config: Any, generation_config: Any = None) -> ModelConfig:
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    rope = _rope_parameters(hf_config)
    # transformers 5 moved partial_rotary_factor into rope_parameters.
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1.0):
        raise ValueError("model: partial rotary embeddings are not supported")
    if rope["rope_type"] not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"model: RoPE type {rope['rope_type']!r} is not supported "
            f"(supported: {', '.join(STATIC_ROPE_TYPES)})"
        )
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    eos = _as_id_set(getattr(hf_config, "eos_token_id", None))
    if generation_config is not None:
        eos |= _as_id_set(getattr(generation_config, "eos_token_id", None))
    max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        # Without sliding-window attention, stay within the window where it equals full attention.
        max_pos = min(max_pos, int(window))
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        max_position_embeddings=max_pos,
        rope_type=rope["rope_type"],
        eos_token_ids=frozenset(eos),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
    )


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor of the config's RoPE variant, from
    transformers' own initialisers so that scaled variants match the reference exactly."""
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] == "default":
        theta = float(rope["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rope_cos_sin(
    inv_freq: torch.Tensor, scaling: float, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 tables ``[max_positions, head_dim // 2]`` of cos and sin, scaled."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if not math.isclose(scaling, 1.0):
        cos, sin = cos * scaling, sin * scaling
    return cos, sin
