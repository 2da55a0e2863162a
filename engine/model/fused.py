"""The elementwise parts of a Llama layer, fused into native kernels on CPU (bfloat16, float32).

At decode batch sizes a layer's RMSNorms, residual adds, RoPE and SiLU-gating are ~40 small
PyTorch ops per layer, each a dispatch plus a pass over memory; the native versions
(``engine/kernels/csrc/fused_ops.c``) do each group in one pass. In bfloat16 they round
wherever the eager ops do, so outputs agree with the reference functions in ``llama.py`` up to
float32 summation order; in float32 they do the eager ops' arithmetic and differ only in
summation order (RMSNorm) and the last bit of e^x (SiLU), less than the matmuls' own variation
between kernels. :func:`enabled` says whether to use them: CPU tensors of either dtype, with the
native library built.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels import native

# The native kernels' name suffix per dtype (``add_rms_norm_bf16``, ``llama_forward_f32``...).
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def enabled(x: torch.Tensor) -> bool:
    return x.dtype in SUFFIX and x.device.type == "cpu" and native.available()


def _kernel(name: str, x: torch.Tensor) -> Any:
    lib = native.load()
    assert lib is not None
    return getattr(lib, f"{name}_{SUFFIX[x.dtype]}")


def _rows(t: torch.Tensor) -> int:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError("fused ops need 2-D tensors with contiguous rows")
    return t.stride(0)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += residual`` in place (when given), then return ``rms_norm(x)``."""
    out = torch.empty_like(x)
    _kernel("add_rms_norm", x)(
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
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("positions: must be a contiguous int64 tensor")
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos/sin: must be contiguous float32 tables")
    _kernel("rope", x)(
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
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    _kernel("silu_mul", gate_up)(
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.shape[0],
        inter,
        _rows(gate_up),
        _rows(out),
        torch.get_num_threads(),
    )
    return out
