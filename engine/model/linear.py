"""Linear layers with weights prepacked for oneDNN on CPU.

``F.linear`` in bfloat16 on CPU reorders the weight into oneDNN's blocked (AMX / AVX512-BF16)
layout on every call; packing it once and calling ``torch.ops.mkldnn._linear_pointwise`` skips
that, which measured faster for this model's shapes at 1-64 rows. In float32,
``F.linear`` is MKL's sgemm, and which of the two wins depends on the CPU (see
:func:`fp32_packed_rows`); the packed copy costs another copy of the weights in memory. Packing
is only used when the op exists in this torch build and a probe matches ``F.linear``; otherwise
:func:`pack_weight` returns None and :func:`linear` uses ``F.linear``.

On a CPU without native bf16 arithmetic (no AVX512-BF16, no AMX) torch's bf16 matmul is
emulated at roughly the cost of one matrix-vector product per input row, several times
float32's time for this model's shapes. Past a few rows :func:`linear`
therefore widens the bf16 weight to float32 a slice at a time, multiplies in float32 and rounds
the output to bf16 (see :func:`upcast_linear`).

On a CPU with AMX, bf16 inputs of up to ``decode_max_rows()`` rows (decode steps) take this
project's AMX kernel instead (``csrc/amx_linear.c``): with its own tile layout of the weight it
streams the weights faster than oneDNN at 1-64 rows, where a step is bound by reading them.
Prefill batches of any size take its prefill kernel over the same tiles
(``csrc/amx_prefill_linear.c``), faster than oneDNN there too. On a CPU with AVX512-BF16 but no
AMX (AMD Zen 4) the same layout feeds a ``vdpbf16ps`` kernel (``csrc/decode_linear.c``), faster
than oneDNN there from 1 to 128 rows; an MLP's gate and up take it at any row count, where its
SiLU epilogue saves a pass over the product. That layout is a third copy of the bf16 weights in
memory. The figures: docs/performance.md, "Figures behind the code".

On a CPU whose widest float32 arithmetic is AVX2 + FMA (no AVX-512: AMD Zen 2/3), float32 inputs
of any number of rows take this project's kernel (``csrc/f32_linear.c``) over its own panel copy
of the weight, which replaces oneDNN's: it beat oneDNN's packed kernel from 1 to 2,048 rows and
MKL's sgemm from 1,024 rows up there (docs/performance.md). Biased layers keep ``F.linear``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.nn.functional as F

from engine.cpuinfo import cpu_has_bf16, cpu_vendor
from engine.kernels import native

logger = logging.getLogger(__name__)


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and mkldnn is not None
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


def fp32_packed_rows(vendor: str) -> range:
    """Rows of a float32 input for which the packed oneDNN kernel beats MKL's sgemm (measured
    at this model's shapes, 2 threads, docs/performance.md).

    On Intel (Sapphire Rapids) oneDNN wins from 4 to 256 rows and loses at 1 row and at
    prefill sizes. On AMD (Zen 3) MKL takes its slower non-Intel code paths and oneDNN wins at
    every row count measured, 1 to 2,048. Other or unknown CPUs keep Intel's range.
    """
    if vendor == "AuthenticAMD":
        return range(1, 1 << 31)
    return range(4, 257)


FP32_PACKED_ROWS = fp32_packed_rows(cpu_vendor())

# bf16 inputs of more rows than this take ``upcast_linear`` on a CPU without native bf16: the
# emulated kernel wins at 1-3 rows (bound by reading the weights, it reads half the bytes),
# float32 from 4 rows on (Zen 3, this model's shapes: ``python -m benchmarks.floors``).
BF16_EMULATED_MAX_ROWS: int | None = None if cpu_has_bf16() else 3
# Weight elements widened per slice: 4 MiB of float32 stays in cache between the conversion that
# writes it and the matmul that reads it; smaller slices cost more in per-slice overhead.
UPCAST_SLICE_ELEMS = 1 << 20
_scratch = threading.local()


# A decode step's batch: up to this many rows the decode linear kernel of this kind
# (``native.decode_linear_kind()``) streams the weights past every row, and the one-call decoder
# stack runs (``native_forward``). AMX beat oneDNN from 1 to 64 rows, tied at 128 and lost at 256
# (``python -m benchmarks.floors``, Sapphire Rapids); the AVX512-BF16 kernel beat oneDNN by 1.7x
# at 1 row, 1.2x at 64, 1.1x at 128 and 1.06x at 192, tied at 256 (Zen 4, docs/performance.md).
DECODE_MAX_ROWS = {"amx": 96, "avx512_bf16": 128}
# bf16 inputs of up to this many rows take the packed tiles (``native.decode_linear``; None: any
# number), oneDNN beyond. On AMX, batches past ``DECODE_MAX_ROWS`` go to the prefill kernel over
# the same tiles (``csrc/amx_prefill_linear.c``), which splits rows between threads: it beat or
# tied oneDNN on this model's four shapes at every count from 128 to 4,096 rows
# (docs/performance.md). AVX512-BF16 keeps its decode bound.
PACKED_MAX_ROWS: dict[str, int | None] = {
    "amx": None,
    "avx512_bf16": DECODE_MAX_ROWS["avx512_bf16"],
}
# An MLP's gated ``[gate; up]`` weight takes the same kernels, with their SiLU epilogue, up to
# this many rows (None: any number): the epilogue saves the separate ``silu_mul`` pass over the
# ``[rows, 2 * inter]`` product. The AVX512-BF16 kernel ties oneDNN's product at prefill sizes and
# beat oneDNN + ``silu_mul`` at every size measured on Zen 4; the AMX prefill kernel runs its
# epilogue between the next block's tile multiplies and beat it at every size from 128 to 4,096
# rows (docs/performance.md).
GATED_MAX_ROWS: dict[str, int | None] = {"amx": None, "avx512_bf16": None}


def decode_max_rows() -> int:
    """The most rows this machine's decode linear kernel takes (0 where none runs)."""
    kind = native.decode_linear_kind()
    return DECODE_MAX_ROWS[kind] if kind is not None else 0


@dataclass(frozen=True)
class PackedWeight:
    """Copies of one linear weight ``[out_features, in]``, made once from it at load time and
    stale as soon as it changes: ``onednn`` in oneDNN's blocked layout (bf16 at any rows, fp32 at
    ``FP32_PACKED_ROWS``), ``decode`` in the decode linear kernels' tiles (bf16, up to
    ``PACKED_MAX_ROWS[kind]`` rows, None where neither kernel runs), ``kind`` the kernel that
    reads them (``"amx"`` or ``"avx512_bf16"``, see ``native.decode_linear_kind``). At least one
    copy is set. ``gated``: the weight is an MLP's ``[gate; up]`` and ``decode`` serves
    :func:`silu_mul_linear` only (its tiles pair gate and up features)."""

    onednn: torch.Tensor | None
    decode: torch.Tensor | None
    out_features: int
    gated: bool = False
    kind: str | None = None
    # float32 only: the panels of ``csrc/f32_linear.c`` (``native.f32_pack_weight``), which every
    # unbiased float32 input takes; None where that kernel is not used.
    f32: torch.Tensor | None = None


def pack_weight(weight: torch.Tensor, gated: bool = False) -> PackedWeight | None:
    """The packed copies of ``weight [out, in]`` (bf16 or fp32, CPU) that this machine can use,
    or None when there are none. ``gated``: ``weight`` is ``[gate; up]`` (see PackedWeight)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if weight.dtype == torch.float32 and native.f32_linear_preferred():
        f32 = native.f32_pack_weight(weight, gated)
        if f32 is not None:
            return PackedWeight(None, None, weight.shape[0], gated, None, f32)
    decode = native.decode_pack_weight(weight, gated) if weight.dtype == torch.bfloat16 else None
    onednn = _onednn_pack(weight)
    if onednn is None and decode is None:
        return None
    kind = native.decode_linear_kind() if decode is not None else None
    return PackedWeight(onednn, decode, weight.shape[0], gated, kind)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    if not _ops_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).view(3, -1)
        expected = F.linear(probe, weight)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError) as exc:
        logger.info("oneDNN weight packing unavailable: %s", exc)
        return None
    tol = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
    if not torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol):
        logger.warning("oneDNN packed linear disagrees with F.linear; not using it")
        return None
    return packed


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    if _takes_f32_kernel(x, bias, packed) and not packed.gated:
        y = native.f32_linear(x, packed.f32, packed.out_features)
        if y is not None:
            return y
    if _takes_decode_kernel(x, bias, packed) and not packed.gated:
        y = native.decode_linear(x, packed.decode, packed.out_features, kind=packed.kind)
        if y is not None:
            return y
    if (
        x.dtype == torch.bfloat16
        and BF16_EMULATED_MAX_ROWS is not None
        and x.shape[0] > BF16_EMULATED_MAX_ROWS
        and x.is_cpu
    ):
        return upcast_linear(x, weight, bias)
    onednn = packed.onednn if packed is not None else None
    if onednn is None or x.dtype != onednn.dtype:
        return F.linear(x, weight, bias)
    if x.dtype == torch.float32 and x.shape[0] not in FP32_PACKED_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")


def silu_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | None,
) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``linear(x, weight, bias, packed)`` for an MLP's ``[gate; up]``
    weight packed with ``gated=True``, in one pass over the weights in the decode linear kernel:
    the product's ``[rows, 2 * inter]`` is never written. None where that path does not apply
    (the caller computes the two steps)."""
    if _takes_f32_kernel(x, bias, packed) and packed.gated:
        return native.f32_linear(x, packed.f32, packed.out_features, True)
    if not (_takes_decode_kernel(x, bias, packed) and packed.gated):
        return None
    return native.decode_linear(x, packed.decode, packed.out_features, True, packed.kind)


def _takes_decode_kernel(
    x: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> TypeGuard[PackedWeight]:
    """Whether ``x`` can take ``packed``'s decode tiles: a gated copy's bound is its epilogue's
    (``GATED_MAX_ROWS``), which only :func:`silu_mul_linear` uses."""
    if (
        packed is None
        or packed.decode is None
        or packed.kind is None
        or bias is not None
        or x.dtype != torch.bfloat16
    ):
        return False
    max_rows = (GATED_MAX_ROWS if packed.gated else PACKED_MAX_ROWS)[packed.kind]
    return max_rows is None or x.shape[0] <= max_rows


def _takes_f32_kernel(
    x: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> TypeGuard[PackedWeight]:
    return (
        packed is not None and packed.f32 is not None and bias is None and x.dtype == torch.float32
    )


def upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` for bf16 ``x [rows, in]`` and ``weight [out, in]`` on CPU, computed in
    float32 and rounded to bf16 once at the end: the same arithmetic as a bf16 kernel with float32
    accumulation (a native one rounds the same way), up to the order of the sums.

    The weight is widened ``UPCAST_SLICE_ELEMS`` elements at a time into a per-thread scratch
    buffer, so no float32 copy of the model is ever held; each slice of output features is one
    float32 matmul, written as rows of the transposed output so every write is contiguous.
    """
    out_features, in_features = weight.shape
    x32 = x.float()
    out_t = torch.empty(out_features, x.shape[0], dtype=torch.float32)
    step = max(1, UPCAST_SLICE_ELEMS // in_features)
    scratch = getattr(_scratch, "buf", None)
    if scratch is None or scratch.numel() < step * in_features:
        scratch = _scratch.buf = torch.empty(step * in_features, dtype=torch.float32)
    for start in range(0, out_features, step):
        end = min(out_features, start + step)
        w32 = scratch[: (end - start) * in_features].view(end - start, in_features)
        w32.copy_(weight[start:end])
        torch.mm(w32, x32.t(), out=out_t[start:end])
    y = out_t.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16, memory_format=torch.contiguous_format)
