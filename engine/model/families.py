"""What sets each supported model family apart from a Llama, read from its Hugging Face config.

One decoder (``engine.model.llama``) serves every family; a family is a set of options of
:class:`engine.model.config.ModelConfig` (q/k norms, Gemma's norms and soft-capping, sliding
layers, partial RoPE) and, in :func:`checkpoint_names`, where its checkpoint keeps the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# Families whose RoPE may rotate only the leading part of each head (partial_rotary_factor).
PARTIAL_ROTARY_MODEL_TYPES = ("phi3",)
# Vision-language checkpoints whose text decoder is served alone (Gemma 3 4B and up): the
# config's text part describes it, and its weights carry a prefix.
MULTIMODAL_MODEL_TYPES = ("gemma3",)
# Prefixes of the text decoder's weights in such checkpoints: as published (and as
# save_pretrained writes them), and as transformers names its modules (``model.language_model``);
# everything else (vision tower, projector) is not read.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _llama(hf_config: Any) -> dict[str, Any]:
    return {}


def _qwen3(hf_config: Any) -> dict[str, Any]:
    return {"qk_norm": True}


def _gemma(hf_config: Any) -> dict[str, Any]:
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ValueError(
            f"model: activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("model: bidirectional attention is not supported")
    layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"model: layer types {sorted(unknown)} are not supported")
    window = getattr(hf_config, "sliding_window", None)
    return {
        "gemma_norm": True,
        "sandwich_norm": True,
        "embed_scale": math.sqrt(hf_config.hidden_size),
        "hidden_act": act,
        "attn_scale": float(hf_config.query_pre_attn_scalar) ** -0.5,
        "attn_softcap": _positive_or_none(getattr(hf_config, "attn_logit_softcapping", None)),
        "final_softcap": _positive_or_none(getattr(hf_config, "final_logit_softcapping", None)),
        "layer_types": layer_types,
        "sliding_window": int(window) if window else None,
    }


def _gemma3(hf_config: Any) -> dict[str, Any]:
    return {**_gemma(hf_config), "qk_norm": True, "local_rope": True}


def _positive_or_none(value: Any) -> float | None:
    return float(value) if value else None


FAMILIES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
    "qwen3": _qwen3,
    "phi3": _llama,
    "gemma2": _gemma,
    "gemma3_text": _gemma3,
}
assert set(FAMILIES) == set(SUPPORTED_MODEL_TYPES)


def family_options(model_type: str, hf_config: Any) -> dict[str, Any]:
    """The ModelConfig fields that ``model_type`` sets beyond a Llama's."""
    return FAMILIES[model_type](hf_config)


def checkpoint_names(layer: int, sandwich_norm: bool) -> dict[str, str]:
    """Checkpoint names (``model.layers.{i}.``-prefixed) of one layer's norms, by the decoder's
    attribute names. Gemma 2/3's ``post_attention_layernorm`` norms the attention output and its
    ``pre_feedforward_layernorm`` is the MLP input norm that Llama calls post-attention."""
    p = f"model.layers.{layer}."
    names = {"input_norm": p + "input_layernorm.weight"}
    if sandwich_norm:
        names |= {
            "attn_out_norm": p + "post_attention_layernorm.weight",
            "post_norm": p + "pre_feedforward_layernorm.weight",
            "mlp_out_norm": p + "post_feedforward_layernorm.weight",
        }
    else:
        names["post_norm"] = p + "post_attention_layernorm.weight"
    return names


def text_config(hf_config: Any) -> Any:
    """The config of the decoder that the engine runs: a vision-language checkpoint's text part
    (``MULTIMODAL_MODEL_TYPES``), else ``hf_config`` itself."""
    if getattr(hf_config, "model_type", "") in MULTIMODAL_MODEL_TYPES:
        return hf_config.text_config
    return hf_config


def text_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text decoder weights under the plain decoder's names
    (``model.layers...``, ``lm_head``); a text checkpoint's weights unchanged."""
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in weights):
        return weights
    out = {}
    for name, tensor in weights.items():
        for prefix, plain in _TEXT_PREFIXES:
            if name.startswith(prefix):
                out[plain + name[len(prefix) :]] = tensor
                break
    return out
