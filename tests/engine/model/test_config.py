"""Reading architecture facts from Hugging Face configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from engine.model.config import model_config_from_hf, rope_cos_sin, rope_inv_freq

BASE = dict(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    eos_token_id=2,
)


def hf(model_type: str = "llama", **overrides) -> object:
    return AutoConfig.for_model(model_type, **{**BASE, **overrides})


def test_llama_facts():
    cfg = model_config_from_hf(hf())
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.q_size, cfg.kv_size) == (64, 32)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    assert cfg.rope_type == "default" and cfg.max_position_embeddings == 512
    assert cfg.eos_token_ids == frozenset({2})
    # K and V, 2 layers, 16 slots, 2 heads of 16 dims, 4 bytes.
    assert cfg.kv_bytes_per_block(16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    assert cfg.kv_bytes_per_block(16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2


def test_biases():
    qwen = model_config_from_hf(hf("qwen2"))
    assert (qwen.qkv_bias, qwen.o_bias) == (True, False)
    llama = model_config_from_hf(hf(attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)


def test_explicit_head_dim_and_missing_kv_heads():
    cfg = model_config_from_hf(hf(head_dim=32))
    assert cfg.head_dim == 32 and cfg.q_size == 128
    no_gqa = SimpleNamespace(**{**hf().to_dict(), "num_key_value_heads": None})
    assert model_config_from_hf(no_gqa).num_kv_heads == 4


def test_eos_ids_merge_the_generation_config():
    cfg = model_config_from_hf(hf(), SimpleNamespace(eos_token_id=[2, 7]))
    assert cfg.eos_token_ids == frozenset({2, 7})


def test_sliding_window_caps_the_context():
    assert model_config_from_hf(hf("mistral", sliding_window=256)).max_position_embeddings == 256
    assert model_config_from_hf(hf("mistral", sliding_window=None)).max_position_embeddings == 512


@pytest.mark.parametrize(
    "config, what",
    [
        pytest.param(SimpleNamespace(model_type="gpt2"), "architecture", id="gpt2"),
        pytest.param(hf(partial_rotary_factor=0.5), "partial rotary", id="partial-rotary"),
        pytest.param(hf(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE", id="dyn"),
    ],
)
def test_unsupported_configs_raise(config, what):
    with pytest.raises(ValueError, match=f"^model:.*{what}"):
        model_config_from_hf(config)


def test_rope_tables():
    inv_freq, scaling = rope_inv_freq(hf(rope_theta=10000.0), 16)
    assert scaling == 1.0
    assert inv_freq.tolist() == pytest.approx([10000.0 ** (-i / 16) for i in range(0, 16, 2)])
    cos, sin = rope_cos_sin(inv_freq, 1.0, 32)
    assert cos.shape == sin.shape == (32, 8) and cos.dtype == torch.float32
    assert cos[5, 1].item() == pytest.approx(torch.cos(torch.tensor(5 * inv_freq[1].item())).item())
    scaled_cos, _ = rope_cos_sin(inv_freq, 2.0, 32)
    assert torch.allclose(scaled_cos, 2 * cos)


def test_linear_rope_scaling_divides_the_frequencies():
    plain, _ = rope_inv_freq(hf(), 16)
    linear, _ = rope_inv_freq(hf(rope_scaling={"rope_type": "linear", "factor": 4.0}), 16)
    assert torch.allclose(linear, plain / 4)
    legacy, _ = rope_inv_freq(hf(rope_scaling={"type": "linear", "factor": 4.0}), 16)
    assert torch.allclose(legacy, linear)


GEMMA = dict(BASE, head_dim=16, query_pre_attn_scalar=32, sliding_window=8)


def test_gemma2_options():
    cfg = model_config_from_hf(AutoConfig.for_model("gemma2", **GEMMA))
    assert cfg.gemma_norm and cfg.sandwich_norm and not cfg.qk_norm and not cfg.local_rope
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.attention_scale == pytest.approx(32**-0.5)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    # Sliding and global layers alternate, the first sliding; windows do not cap the context.
    assert [cfg.layer_window(i) for i in range(2)] == [8, None]
    assert cfg.max_position_embeddings == 512
    assert not cfg.is_plain_llama


def test_gemma3_options_and_local_rope_tables():
    from engine.model.config import rope_tables

    hf_config = AutoConfig.for_model(
        "gemma3_text", **GEMMA, layer_types=["sliding_attention", "full_attention"]
    )
    cfg = model_config_from_hf(hf_config)
    assert cfg.qk_norm and cfg.local_rope and cfg.attn_softcap is None
    cos, sin, local = rope_tables(hf_config, cfg, 64)
    global_freq, _ = rope_inv_freq(hf_config, 16, "full_attention")
    local_freq, _ = rope_inv_freq(hf_config, 16, "sliding_attention")
    # Gemma 3's defaults: base 1e6 for global layers, 1e4 for sliding ones.
    assert global_freq.tolist() == pytest.approx([1e6 ** (-i / 16) for i in range(0, 16, 2)])
    assert local_freq.tolist() == pytest.approx([1e4 ** (-i / 16) for i in range(0, 16, 2)])
    assert torch.allclose(local[0], rope_cos_sin(local_freq, 1.0, 64)[0])
    assert not torch.allclose(cos, local[0])


def test_qwen3_and_phi3_options():
    qwen3 = model_config_from_hf(hf("qwen3", head_dim=32))
    assert qwen3.qk_norm and qwen3.q_size == 128 and qwen3.is_plain_llama
    assert not qwen3.qkv_bias
    phi = model_config_from_hf(hf("phi3", partial_rotary_factor=0.75))
    assert (phi.head_dim, phi.rope_dim) == (16, 12) and not phi.is_plain_llama
    assert model_config_from_hf(hf("phi3")).is_plain_llama


@pytest.mark.parametrize(
    "overrides, what",
    [
        pytest.param({"hidden_activation": "relu"}, "activation", id="activation"),
        pytest.param({"use_bidirectional_attention": True}, "bidirectional", id="bidirectional"),
    ],
)
def test_unsupported_gemma_configs_raise(overrides, what):
    with pytest.raises(ValueError, match=f"^model:.*{what}"):
        model_config_from_hf(AutoConfig.for_model("gemma3_text", **{**GEMMA, **overrides}))


def test_windowed_or_capped_models_take_the_torch_backend():
    from engine.attention.base import backend_for_model
    from engine.attention.torch_backend import TorchAttentionBackend

    torch_backend = TorchAttentionBackend()
    assert backend_for_model(torch_backend, True, True) is torch_backend

    class NoOptions(TorchAttentionBackend):
        name = "no-options"
        supports_window = supports_softcap = False

    plain = NoOptions()
    assert backend_for_model(plain, False, False) is plain
    assert backend_for_model(plain, True, False).name == "torch"
    assert backend_for_model(plain, False, True).name == "torch"


# Sizes and RoPE settings as the published configs have them (Phi-4-mini: 3/4 of 128 dims with
# longrope from 4k to 128k; Gemma 3 4B: linear x8 on global layers, base 1e4 on local ones;
# Llama 3.1 8B: llama3 scaling).
PUBLISHED_ROPE = {
    "phi4-mini": (
        "phi3",
        dict(
            hidden_size=3072,
            num_attention_heads=24,
            num_key_value_heads=8,
            partial_rotary_factor=0.75,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_theta=10000.0,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.02 * i for i in range(48)],
                "long_factor": [1.0 + 0.75 * i for i in range(48)],
            },
        ),
    ),
    "gemma3-4b": (
        "gemma3_text",
        dict(
            hidden_size=2560,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            max_position_embeddings=131072,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "llama3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED_ROPE))
def test_rope_tables_match_transformers_rotary_embeddings(name):
    """Our cos/sin rows against the transformers model's own rotary module at the same
    positions, for every layer type; longrope past its original length (the long factors)."""
    from transformers import AutoModelForCausalLM

    from engine.model.config import rope_tables

    model_type, sizes = PUBLISHED_ROPE[name]
    hf_config = AutoConfig.for_model(
        model_type, **{**BASE, **sizes, "num_hidden_layers": 2, "vocab_size": 8, "pad_token_id": 0}
    )
    cfg = model_config_from_hf(hf_config)
    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 5000, 20000, 131071])
    cos, sin, local = rope_tables(hf_config, cfg, 131072)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    rotary_cls = type(skeleton.model.rotary_emb)
    rotary = rotary_cls(config=hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    half = cfg.rope_dim // 2
    layer_tables = {"full_attention": (cos, sin), "sliding_attention": local}
    for layer_type in ("full_attention", "sliding_attention") if cfg.local_rope else (None,):
        kwargs = {"layer_type": layer_type} if layer_type else {}
        ref_cos, ref_sin = rotary(x, positions[None, :], **kwargs)
        ours_cos, ours_sin = layer_tables[layer_type or "full_attention"]
        torch.testing.assert_close(ours_cos[positions], ref_cos[0, :, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours_sin[positions], ref_sin[0, :, :half], rtol=0, atol=1e-6)
