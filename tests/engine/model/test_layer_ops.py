"""The two op sets of the layer loop keep one contract: the fused kernels give what the
reference PyTorch ops give (float32: to rounding), and the residual they return is ``x +
delta``."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import native
from engine.model.config import ModelConfig
from engine.model.layer_ops import FusedOps, ReferenceOps

needs_kernel = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

CFG = ModelConfig(
    model_type="qwen3",
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    max_position_embeddings=64,
    rope_type="default",
    eos_token_ids=frozenset({0}),
    bos_token_id=None,
    qk_norm=True,
)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _rope_tables() -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, CFG.head_dim, 2).float() / CFG.head_dim))
    angles = torch.outer(torch.arange(CFG.max_position_embeddings).float(), inv_freq)
    return angles.cos(), angles.sin()


def _both(positions: torch.Tensor) -> tuple[ReferenceOps, FusedOps]:
    rope = _rope_tables()
    return ReferenceOps(CFG, rope, None, positions, torch.float32), FusedOps(CFG, rope, positions)


@needs_kernel
def test_fused_ops_give_the_reference_ops_results() -> None:
    gen = torch.Generator().manual_seed(0)
    t = 5
    positions = torch.tensor([0, 1, 2, 7, 30])
    ref, fus = _both(positions)
    x = torch.randn(t, CFG.hidden_size, generator=gen)
    delta = torch.randn(t, CFG.hidden_size, generator=gen)
    w = torch.randn(CFG.hidden_size, generator=gen)

    ref_x, ref_h = ref.add_norm(x, delta, w)
    fused_in = x.clone()
    fus_x, fus_h = fus.add_norm(fused_in, delta, w)
    torch.testing.assert_close(ref_x, x + delta, atol=0, rtol=0)
    assert fus_x is fused_in  # the fused residual add happens in place
    torch.testing.assert_close(fus_x, x + delta, **TOL)
    torch.testing.assert_close(fus_h, ref_h, **TOL)

    qkv = torch.randn(t, CFG.q_size + 2 * CFG.kv_size, generator=gen)
    q_norm, k_norm = torch.randn(CFG.head_dim, generator=gen), torch.randn(CFG.head_dim)
    expected = ref.qkv_heads(qkv.clone(), q_norm, k_norm, 0)
    got = fus.qkv_heads(qkv.clone(), q_norm, k_norm, 0)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, **TOL)

    gate_up = torch.randn(2 * CFG.intermediate_size, CFG.hidden_size, generator=gen)
    h = torch.randn(t, CFG.hidden_size, generator=gen)
    torch.testing.assert_close(
        fus.mlp_act(h, gate_up, None, None), ref.mlp_act(h, gate_up, None, None), **TOL
    )


def test_first_add_norm_and_out_norm() -> None:
    ref = ReferenceOps(CFG, _rope_tables(), None, torch.tensor([0]), torch.float32)
    x = torch.randn(3, CFG.hidden_size)
    w = torch.randn(CFG.hidden_size)
    same, h = ref.add_norm(x, None, w)
    assert same is x
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps))
    torch.testing.assert_close(h, expected)
    assert ref.out_norm(x, None) is x
    torch.testing.assert_close(ref.out_norm(x, w), expected)
    fus = FusedOps(CFG, _rope_tables(), torch.tensor([0]))
    assert fus.out_norm(x, None) is x
    with pytest.raises(ValueError, match="sandwich"):
        fus.out_norm(x, w)
