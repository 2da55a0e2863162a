"""The elementwise ops of a decoder layer, in two interchangeable sets that
:meth:`engine.model.llama.LlamaForCausalLM.forward` runs the same layer loop over.

- :class:`ReferenceOps`: PyTorch ops in transformers' order (RMSNorm in float32, rotate-half
  RoPE from float32 tables cast to the model dtype), every family's options included; what
  float32 greedy decoding is token-identical to transformers with.
- :class:`FusedOps`: the native kernels of ``engine.model.fused`` on CPU, for a plain Llama
  (``ModelConfig.is_plain_llama``): the residual add folded into the next RMSNorm, RoPE in
  place on q and k inside the qkv output, SiLU(gate) * up in one pass (or inside the decode
  linear kernel).

Both are made once per step (they hold the step's RoPE rows) and share one contract:
``add_norm(x, delta, w)`` returns the residual stream ``x + delta`` (``x`` itself when ``delta``
is None) and its RMSNorm with ``w``; the fused set updates ``x`` in place, so a caller passes an
``x`` it owns (the layer loop's own embedding output) and uses only the returned residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import fused
from engine.model.config import ModelConfig
from engine.model.linear import PackedWeight, linear, silu_mul_linear


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> torch.Tensor:
    """Llama's RMSNorm (normed x cast to the dtype, then times w), or with ``gemma`` Gemma's
    (times 1 + w in float32, then cast)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]``; ``cos``/``sin [T, 1, R/2]`` in x's dtype: rotates the first ``R``
    dims of each head (all of them unless RoPE is partial) and passes the rest."""
    rot = 2 * cos.shape[-1]
    xr = x[..., :rot]
    half = rot // 2
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's ``cap * tanh(x / cap)``, in transformers' order of operations."""
    return torch.tanh(x / cap) * cap


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def _rope_rows(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)


def _split_heads(
    qkv: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [T, H, D]``, ``k``/``v [T, Hkv, D]`` of the rows of ``qkv``."""
    t, q_size, kv_size = qkv.shape[0], cfg.q_size, cfg.kv_size
    q = qkv[:, :q_size].view(t, cfg.num_heads, cfg.head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, q_size + kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


class ReferenceOps:
    """PyTorch ops, for every family; one instance per step."""

    def __init__(
        self,
        cfg: ModelConfig,
        rope: tuple[torch.Tensor, torch.Tensor],
        local_rope: tuple[torch.Tensor, torch.Tensor] | None,
        positions: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        self.cfg = cfg
        # The step's RoPE rows: the global tables', and the sliding layers' own (cfg.local_rope).
        self.rope = {False: _rope_rows(*rope, positions, dtype)}
        if cfg.local_rope and local_rope is not None:
            self.rope[True] = _rope_rows(*local_rope, positions, dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.gemma_norm)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            x = x + delta
        return x, self.norm(x, weight)

    def out_norm(self, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output as added to the residual: normed where the family has sandwich
        norms (``weight`` given, Gemma), else as is."""
        return y if weight is None else self.norm(y, weight)

    def qkv_heads(
        self,
        qkv: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed where the family norms them, then rotated) and v of layer ``layer``."""
        cfg = self.cfg
        q, k, v = _split_heads(qkv, cfg)
        if q_norm is not None and k_norm is not None:
            q, k = self.norm(q, q_norm), self.norm(k, k_norm)
        cos, sin = self.rope[cfg.local_rope and cfg.layer_window(layer) is not None]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def mlp_act(
        self,
        h: torch.Tensor,
        gate_up: torch.Tensor,
        bias: torch.Tensor | None,
        packed: PackedWeight | None,
    ) -> torch.Tensor:
        """The gated activation of the MLP's input projection of ``h``."""
        gate, up = linear(h, gate_up, bias, packed).chunk(2, dim=-1)
        return gated_act(gate, up, self.cfg.hidden_act)


class FusedOps:
    """The native elementwise kernels, for a plain Llama on CPU; one instance per step."""

    def __init__(
        self, cfg: ModelConfig, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
    ) -> None:
        self.cfg = cfg
        self.cos, self.sin = rope
        self.positions = positions.contiguous()

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x, fused.add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps)

    def out_norm(self, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is not None:
            raise ValueError("fused ops: a plain Llama has no sandwich norms")
        return y

    def qkv_heads(
        self,
        qkv: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of q, k and v inside ``qkv``, q and k normed (Qwen3) and rotated in place."""
        cfg = self.cfg
        q, k, v = _split_heads(qkv, cfg)
        if q_norm is not None and k_norm is not None:
            q.copy_(rms_norm(q, q_norm, cfg.rms_norm_eps))
            k.copy_(rms_norm(k, k_norm, cfg.rms_norm_eps))
        heads = cfg.num_heads + cfg.num_kv_heads
        fused.rope_(qkv, self.positions, self.cos, self.sin, heads, cfg.head_dim)
        return q, k, v

    def mlp_act(
        self,
        h: torch.Tensor,
        gate_up: torch.Tensor,
        bias: torch.Tensor | None,
        packed: PackedWeight | None,
    ) -> torch.Tensor:
        act = silu_mul_linear(h, gate_up, bias, packed)
        if act is None:
            act = fused.silu_mul(linear(h, gate_up, bias, packed))
        return act
