"""The elementwise parts of a Llama layer, fused into native kernels for bfloat16 on CPU.

At decode batch sizes a layer's RMSNorms, residual adds, RoPE and SiLU-gating are ~40 small
PyTorch ops per layer, each a dispatch plus a pass over memory; the native versions
(``engine/attention/csrc/fused_ops.c``) do each group in one pass. They round to bfloat16
wherever the eager ops do, so outputs agree with the reference functions in ``llama.py`` up to
float32 summation order. :func:`enabled` says whether to use them: bf16 CPU tensors with the
native library built; float32 always takes the reference path (token identity with transformers).
"""

from __future__ import annotations

import torch

from engine.attention import native


def enabled(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and native.available()


def _rows(t: torch.Tensor) -> int:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError("fused ops need 2-D tensors with contiguous rows")
    return t.stride(0)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += residual`` in place (when given), then return ``rms_norm(x)``."""
    lib = native.load()
    assert lib is not None
    out = torch.empty_like(x)
    lib.add_rms_norm_bf16(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        _rows(x),
        _rows(residual) if residual is not None else 0,
        _rows(out),
        eps,
        torch.get_num_threads(),
    )
    return out


def rope_(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    head_dim: int,
) -> None:
    """RoPE in place on the first ``heads`` heads of each row of ``x [T, >= heads * head_dim]``;
    ``cos``/``sin`` are the float32 tables ``[max_pos, head_dim // 2]``."""
    lib = native.load()
    assert lib is not None
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("positions: must be a contiguous int64 tensor")
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos/sin: must be contiguous float32 tables")
    lib.rope_bf16(
        x.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        x.shape[0],
        heads,
        head_dim,
        _rows(x),
        torch.get_num_threads(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    lib = native.load()
    assert lib is not None
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    lib.silu_mul_bf16(
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.shape[0],
        inter,
        _rows(gate_up),
        _rows(out),
        torch.get_num_threads(),
    )
    return out
