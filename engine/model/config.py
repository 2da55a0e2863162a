"""The architecture facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.families import (
    PARTIAL_ROTARY_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    family_options,
    text_config,
)

# RoPE variants whose frequencies do not depend on the sequence being processed, and longrope,
# whose factor set is fixed once per engine from its maximum length (see rope_inv_freq).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SLIDING = "sliding_attention"


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
    # Per-family options (engine.model.families); the defaults describe a Llama.
    # RMSNorm of each head of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # RMSNorm multiplies by (1 + weight) in float32 before the cast back (Gemma).
    gemma_norm: bool = False
    # Gemma 2/3: the attention and MLP outputs are normed before their residual add, and the
    # MLP input has its own norm (pre_feedforward_layernorm).
    sandwich_norm: bool = False
    # Embeddings are multiplied by this (Gemma: sqrt(hidden), rounded to the model dtype).
    embed_scale: float | None = None
    # "silu" or "gelu_pytorch_tanh", applied to the gate of the gated MLP.
    hidden_act: str = "silu"
    # Softmax scale of the attention scores; None: head_dim ** -0.5.
    attn_scale: float | None = None
    # tanh soft-capping of the attention scores and of the final logits (Gemma 2).
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Leading dims of each head that RoPE rotates (Phi-4-mini: 0.75 of head_dim); None: all.
    rotary_dim: int | None = None
    # Per layer "full_attention" or "sliding_attention" (empty: all full); sliding layers attend
    # to the last ``sliding_window`` positions, their own included.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # Sliding layers have a RoPE of their own (Gemma 3's local base frequency).
    local_rope: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to the whole context."""
        if self.sliding_window and self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def is_plain_llama(self) -> bool:
        """Whether the model is a Llama in every respect that the fused and native CPU paths
        compute (they cover nothing else)."""
        return (
            not self.gemma_norm
            and not self.sandwich_norm
            and self.embed_scale is None
            and self.hidden_act == "silu"
            and self.attn_softcap is None
            and self.final_softcap is None
            and self.rope_dim == self.head_dim
            and not any(self.layer_window(i) for i in range(self.num_layers))
            and not self.local_rope
        )

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


def _rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """transformers 5 writes ``rope_parameters``, nested by layer type for models whose layers
    differ (Gemma 3); older configs have ``rope_theta`` and ``rope_scaling``. Read all three."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
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
    outer_eos = getattr(hf_config, "eos_token_id", None)
    hf_config = text_config(hf_config)
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    options = family_options(model_type, hf_config)
    rope = _rope_parameters(hf_config, "full_attention")
    # transformers 5 moved partial_rotary_factor into rope_parameters.
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1.0):
        if model_type not in PARTIAL_ROTARY_MODEL_TYPES:
            raise ValueError("model: partial rotary embeddings are not supported")
        options["rotary_dim"] = int(head_dim * partial)
    rope_types = [rope["rope_type"]]
    if options.get("local_rope"):
        rope_types.append(_rope_parameters(hf_config, SLIDING)["rope_type"])
    for rope_type in rope_types:
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"model: RoPE type {rope_type!r} is not supported "
                f"(supported: {', '.join(STATIC_ROPE_TYPES)})"
            )
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    eos = _as_id_set(getattr(hf_config, "eos_token_id", None)) | _as_id_set(outer_eos)
    if generation_config is not None:
        eos |= _as_id_set(getattr(generation_config, "eos_token_id", None))
    max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
    window = getattr(hf_config, "sliding_window", None)
    if window and not options.get("layer_types") and getattr(hf_config, "use_sliding_window", True):
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
        **options,
    )


def rope_inv_freq(
    hf_config: Any, head_dim: int, layer_type: str | None = None, max_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor of the config's RoPE variant (of
    ``layer_type``'s layers where they differ), from transformers' own initialisers so that
    scaled variants match the reference exactly. ``head_dim``: the rotated dims of a head.

    longrope picks its long factors for sequences longer than the pretraining length; the
    reference decides per forward call from the longest position so far, without recomputing
    cached keys. Here one set serves the whole engine: the long one when ``max_len`` exceeds the
    pretraining length. The two agree for every sequence of such an engine that starts beyond
    that length, and for every sequence of an engine that stays within it."""
    rope = _rope_parameters(hf_config, layer_type)
    if rope["rope_type"] == "default":
        theta = float(rope["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs: dict[str, Any] = {}
    if layer_type is not None and isinstance(
        (getattr(hf_config, "rope_parameters", None) or {}).get(layer_type), dict
    ):
        kwargs["layer_type"] = layer_type
    if rope["rope_type"] == "longrope":
        kwargs["seq_len"] = max_len
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    inv_freq, scaling = init(hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def rope_tables(
    hf_config: Any, cfg: ModelConfig, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The cos/sin tables of the full-attention layers, and those of the sliding layers where
    they have their own (``cfg.local_rope``), else None."""
    hf_config = text_config(hf_config)
    inv_freq, scaling = rope_inv_freq(hf_config, cfg.rope_dim, "full_attention", max_positions)
    cos, sin = rope_cos_sin(inv_freq, scaling, max_positions)
    local = None
    if cfg.local_rope:
        inv_freq, scaling = rope_inv_freq(hf_config, cfg.rope_dim, SLIDING, max_positions)
        local = rope_cos_sin(inv_freq, scaling, max_positions)
    return cos, sin, local


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
