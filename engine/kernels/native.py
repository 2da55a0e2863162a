"""Optional native (C, OpenMP) kernels, loaded through ctypes: paged attention over a flat batch,
a row-wise argmax for greedy sampling, fused elementwise ops (``engine.model.fused``) and bf16
linear layers for decode-sized batches on AMX or AVX512-BF16 (``engine.model.linear``).

The kernel is compiled on first use with the system C compiler (``$CC`` or ``cc``) into the cache
directory, keyed by a hash of its source, the compiler flags and the CPU, so a process builds it
at most once per machine (the build is atomic; ``kernel_cache`` says when a cached library may be
loaded). Nothing here needs a
Python build toolchain: no torch headers, no pybind11, no ninja. When no compiler is found, the
build fails, or ``PREFIXSERVE_NATIVE_KERNELS=0``, :func:`load` returns None and callers use the
pure-PyTorch path.

The library links against the process's already-loaded ``libgomp`` (torch's), so its OpenMP
threads are the ones torch uses and it runs with ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cpuinfo import cpu_flags, cpu_vendor
from engine.kernels import kernel_cache

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    CSRC / "paged_attention.c",
    CSRC / "fused_ops.c",
    CSRC / "argmax.c",
    CSRC / "amx_linear.c",
    CSRC / "amx_prefill_linear.c",
    CSRC / "decode_linear.c",
    CSRC / "llama_forward.c",
    CSRC / "f32_linear.c",
    CSRC / "attention_tile_bf16.c",
    CSRC / "attention_decode_bf16.c",
    CSRC / "attention_amx.c",
)
HEADERS = (
    CSRC / "amx.h",
    CSRC / "attention_amx.h",
    CSRC / "attention_decode_bf16.h",
    CSRC / "attention_tile_bf16.h",
    CSRC / "bf16.h",
    CSRC / "bf16x16.h",
    CSRC / "vec16.h",
    CSRC / "work_share.h",
)
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: with it gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads (subnormal floats in torch, numpy
# and Python arithmetic would read as 0).
LDFLAGS = ["-shared", "-fopenmp"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
ENV_SWITCH = "PREFIXSERVE_NATIVE_KERNELS"


def _cpu_signature() -> str:
    return " ".join(sorted(cpu_flags())) or platform.processor()


def _cache_dir() -> Path:
    from engine.model.loader import cache_dir

    return cache_dir() / "kernels"


# Why the last load() found no library: a short code (a metric label) or None.
_unavailable_reason: str | None = None


def _unavailable(reason: str, detail: str, level: int = logging.WARNING) -> None:
    """Record and log why the kernels are unavailable. A WARNING unless asked for: without them
    every step runs the PyTorch path, several times slower on CPU (docs/performance.md)."""
    global _unavailable_reason
    _unavailable_reason = reason
    logger.log(
        level, "native kernels unavailable (%s): %s; the engine runs the slower PyTorch path",
        reason, detail,
    )  # fmt: skip


def unavailable_reason() -> str | None:
    """None when the kernels are loaded; else ``disabled`` (PREFIXSERVE_NATIVE_KERNELS=0),
    ``not_linux``, ``no_compiler`` or ``build_failed``."""
    return None if load() is not None else _unavailable_reason


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it is disabled or cannot be built."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _unavailable("disabled", f"{ENV_SWITCH}=0", logging.INFO)
        return None
    if platform.system() != "Linux":
        _unavailable("not_linux", f"they are built for Linux only, not {platform.system()}")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        _unavailable("no_compiler", "no C compiler found (install gcc, or set $CC)")
        return None
    try:
        path = kernel_cache.cached_library(
            SOURCES, HEADERS, compiler, CFLAGS, LDFLAGS, _cpu_signature(), _cache_dir()
        )
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        _unavailable("build_failed", f"{exc} {detail.decode()[-500:]}")
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn = lib.paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ptr,  # q
        ptr,  # k_cache
        ptr,  # v_cache
        ptr,  # block_tables
        ptr,  # seq_lens
        ptr,  # query_start
        ptr,  # query_len
        ptr,  # out
        ptr,  # lse (float32) or NULL
        i32,  # num_seqs
        i32,  # num_heads
        i32,  # num_kv_heads
        i32,  # head_dim
        i32,  # block_size
        i64,  # bt_stride
        i64,  # q_stride
        i64,  # out_stride
        i64,  # kv_start
        ctypes.c_float,  # scale
        i32,  # dtype
        i32,  # num_threads
    ]
    am = lib.argmax_rows
    am.restype = None
    am.argtypes = [
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # rows
        ctypes.c_int64,  # cols
        ctypes.c_int64,  # row stride
        ctypes.c_int,  # dtype
        ctypes.c_void_p,  # out (int64)
        ctypes.c_int,  # num_threads
    ]
    lib.write_kv_cache.restype = None
    lib.write_kv_cache.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]
    lib.merge_attention.restype = None
    lib.merge_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i64, i64, i32, i32]
    lib.amx_linear_available.restype = i32
    lib.amx_linear_available.argtypes = []
    lib.bf16_linear_available.restype = i32
    lib.bf16_linear_available.argtypes = []
    lib.bf16_tile_available.restype = i32
    lib.bf16_tile_available.argtypes = []
    lib.bf16_decode_available.restype = i32
    lib.bf16_decode_available.argtypes = []
    lib.decode_pack_weight.restype = None
    lib.decode_pack_weight.argtypes = [ptr, i64, i64, i32, ptr]
    for name in ("amx_linear", "bf16_linear"):
        kernel = getattr(lib, name)
        kernel.restype = i32
        kernel.argtypes = [ptr, i64, i64, i64, ptr, i64, i32, ptr, i64, i32]
    lib.f32_linear_available.restype = i32
    lib.f32_linear_available.argtypes = []
    lib.f32_packed_blocks.restype = i64
    lib.f32_packed_blocks.argtypes = [i64, i32]
    lib.f32_pack_weight.restype = None
    lib.f32_pack_weight.argtypes = [ptr, i64, i64, i32, ptr]
    lib.f32_linear.restype = i32
    lib.f32_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, i32, ptr, i64, i32]
    for suffix in ("bf16", "f32"):
        stack = getattr(lib, f"llama_forward_{suffix}")
        stack.restype = i32
        stack.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, i32]
        pre = getattr(lib, f"llama_layer_pre_{suffix}")
        pre.restype = i32
        pre.argtypes = [ptr, i32, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32]
        post = getattr(lib, f"llama_layer_post_{suffix}")
        post.restype = i32
        post.argtypes = [ptr, i32, ptr, ptr, ptr, ptr, ptr, i64, i32]
        final = getattr(lib, f"llama_final_norm_{suffix}")
        final.restype = None
        final.argtypes = [ptr, ptr, ptr, i64, ptr, i32]
        norm = getattr(lib, f"add_rms_norm_{suffix}")
        norm.restype = None
        norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i32]
        rope = getattr(lib, f"rope_{suffix}")
        rope.restype = None
        rope.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
        silu = getattr(lib, f"silu_mul_{suffix}")
        silu.restype = None
        silu.argtypes = [ptr, ptr, i64, i64, i64, i64, i32]
    return lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D float32/bfloat16 CPU tensor without NaN: one pass over the
    row for the maximum and a short scan for its first index (torch's argmax tracks indices in
    its reduction and is several times slower on ``[64, 49152]``). Falls back to torch."""
    lib = load()
    code = DTYPE_CODES.get(x.dtype)
    if lib is None or code is None or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
        return x.argmax(dim=-1)
    if x.shape[0] == 0 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        code,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def available() -> bool:
    return load() is not None


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernels run here: the library was built for a CPU with AMX (bf16) and
    Linux granted the process the tile state."""
    lib = load()
    return lib is not None and bool(lib.amx_linear_available())


@functools.cache
def avx512_bf16_available() -> bool:
    """Whether the AVX512-BF16 decode linear kernel runs here: the CPU reports ``avx512_bf16``
    and the library was built with it (``-march=native`` on such a CPU)."""
    lib = load()
    return lib is not None and "avx512_bf16" in cpu_flags() and bool(lib.bf16_linear_available())


@functools.cache
def bf16_prefill_preferred() -> bool:
    """Whether bf16 prefill chunks of any length should take the native kernel rather than SDPA:
    it runs them on AMX tiles where the CPU has AMX (``csrc/attention_amx.c``), else on its
    AVX512-BF16 tile (``csrc/attention_tile_bf16.c``) where the CPU has AVX512-BF16; both measured
    faster than SDPA at every length (docs/performance.md)."""
    lib = load()
    return lib is not None and (
        amx_available() or ("avx512_bf16" in cpu_flags() and bool(lib.bf16_tile_available()))
    )


@functools.cache
def bf16_decode_one_pass() -> bool:
    """Whether a bf16 decode step's attention takes the AVX512-BF16 kernel that reads each
    sequence's cache rows once for all KV heads (``csrc/attention_decode_bf16.c``): the CPU has
    AVX512-BF16 and no AMX (where AMX runs, its own one-pass kernel takes decodes), and the
    library was built with it. Shapes it does not take (head_dim not a multiple of 64, blocks
    not of 16) keep the per-head loop."""
    lib = load()
    return (
        lib is not None
        and not amx_available()
        and "avx512_bf16" in cpu_flags()
        and bool(lib.bf16_decode_available())
    )


# The decode linear kernels, by the name PackedWeight.kind and decode_linear take.
DECODE_KERNELS = {"amx": "amx_linear", "avx512_bf16": "bf16_linear"}


@functools.cache
def decode_linear_kind() -> str | None:
    """The decode linear kernel this process runs (``csrc/decode_linear.c``): ``"amx"`` where
    AMX may be used, else ``"avx512_bf16"`` where the CPU has AVX512-BF16 (AMD Zen 4, Intel
    Cooper Lake), else None. The C side (``decode_linear``, which the one-call decoder stack
    calls) makes the same choice."""
    if amx_available():
        return "amx"
    if avx512_bf16_available():
        return "avx512_bf16"
    return None


def _decode_packed_numel(out_features: int, in_features: int, gated: bool) -> int:
    pairs = -(-out_features // 2 // 16) if gated else -(-out_features // 32)
    return pairs * 2 * -(-in_features // 32) * 512


def decode_pack_weight(weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
    """``weight [out, in]`` (bf16, CPU) in the tile layout the decode linear kernels stream
    (both kinds read the same one; see ``csrc/decode_linear.c``), or None where neither kernel
    runs. ``gated``: the weight is ``[gate; up]`` (an even number of rows) and the copy is for
    :func:`decode_linear`'s SiLU epilogue only."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or decode_linear_kind() is None:
        return None
    n, k = weight.shape
    if gated and n % 2:
        raise ValueError(f"decode_pack_weight: a gated weight has an even number of rows, got {n}")
    lib = load()
    assert lib is not None
    w = weight.detach().contiguous()
    out = torch.empty(_decode_packed_numel(n, k, gated), dtype=torch.bfloat16)
    lib.decode_pack_weight(w.data_ptr(), n, k, int(gated), out.data_ptr())
    return out


def _run_linear(
    fn: Callable[..., int], x: torch.Tensor, packed: torch.Tensor, out_features: int, gated: bool
) -> torch.Tensor | None:
    """Call a packed linear kernel (the decode kernels and the float32 one share the signature)
    into a fresh ``[rows, out_features (/ 2 when gated)]`` of ``x``'s dtype; None if it fails."""
    rows, k = x.shape
    y = torch.empty(rows, out_features // 2 if gated else out_features, dtype=x.dtype)
    if rows == 0:
        return y
    rc = fn(
        x.data_ptr(),
        rows,
        k,
        x.stride(0),
        packed.data_ptr(),
        out_features,
        int(gated),
        y.data_ptr(),
        y.stride(0),
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


def decode_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    gated: bool = False,
    kind: str | None = None,
) -> torch.Tensor | None:
    """``x [rows, in] @ weight.T`` in bf16 with float32 sums, from :func:`decode_pack_weight`'s
    copy of ``weight [out_features, in]``; with ``gated``, ``silu(gate) * up`` of that product
    instead (``[rows, out_features / 2]``, rounded as the eager bf16 ops round). ``kind``: the
    kernel (a key of ``DECODE_KERNELS``), by default :func:`decode_linear_kind`'s. None (the
    caller falls back) when ``x`` is not a bf16 CPU matrix with contiguous rows or the kernel
    cannot run."""
    lib = load()
    kind = kind or decode_linear_kind()
    if lib is None or kind is None or x.dtype != torch.bfloat16 or x.dim() != 2:
        return None
    if x.stride(1) != 1 or x.device.type != "cpu":
        return None
    rows, k = x.shape
    if packed.numel() != _decode_packed_numel(out_features, k, gated):
        raise ValueError(f"decode_linear: packed weight does not match [{out_features}, {k}]")
    return _run_linear(getattr(lib, DECODE_KERNELS[kind]), x, packed, out_features, gated)


@functools.cache
def f32_kernel_available() -> bool:
    """Whether the float32 linear kernel (``csrc/f32_linear.c``) was built: with AVX2 + FMA or
    AVX-512."""
    lib = load()
    return lib is not None and bool(lib.f32_linear_available())


def f32_kernel_wins(flags: frozenset[str], vendor: str) -> bool:
    """Whether the float32 kernel beats oneDNN's packed kernel on a CPU with these flags and
    this vendor, as measured (``python -m benchmarks.floors``, docs/performance.md): without
    AVX-512 (AVX2 + FMA: AMD Zen 2/3, Intel laptops), and on AMD's AVX-512 (Zen 4), where it
    beat oneDNN at decode sizes (1-128 rows) and tied it at prefill sizes (512-2,048). On
    Intel's AVX-512 it has not been measured against oneDNN, so oneDNN stays there."""
    return "avx512f" not in flags or vendor == "AuthenticAMD"


@functools.cache
def f32_linear_preferred() -> bool:
    """Whether float32 linears take that kernel here: built, and :func:`f32_kernel_wins` on
    this CPU."""
    return f32_kernel_available() and f32_kernel_wins(cpu_flags(), cpu_vendor())


def f32_pack_weight(weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
    """``weight [out, in]`` (float32, CPU) in the panel layout :func:`f32_linear` streams, or
    None where that kernel is not built. ``gated``: as for :func:`decode_pack_weight`."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not f32_kernel_available():
        return None
    n, k = weight.shape
    if gated and n % 2:
        raise ValueError(f"f32_pack_weight: a gated weight has an even number of rows, got {n}")
    lib = load()
    assert lib is not None
    w = weight.detach().contiguous()
    out = torch.empty(lib.f32_packed_blocks(n, int(gated)) * k * 16, dtype=torch.float32)
    lib.f32_pack_weight(w.data_ptr(), n, k, int(gated), out.data_ptr())
    return out


def f32_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, gated: bool = False
) -> torch.Tensor | None:
    """``x [rows, in] @ weight.T`` in float32 from :func:`f32_pack_weight`'s copy of ``weight
    [out_features, in]``; with ``gated``, ``silu(gate) * up`` of it (``[rows, out_features /
    2]``). None (the caller falls back) when ``x`` is not a float32 CPU matrix with contiguous
    rows or the kernel is not built."""
    lib = load()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2:
        return None
    if x.stride(1) != 1 or x.device.type != "cpu":
        return None
    rows, k = x.shape
    if packed.numel() != lib.f32_packed_blocks(out_features, int(gated)) * k * 16:
        raise ValueError(f"f32_linear: packed weight does not match [{out_features}, {k}]")
    return _run_linear(lib.f32_linear, x, packed, out_features, gated)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    kv_start: int = 0,
    lse: torch.Tensor | None = None,
) -> None:
    """Write into rows of ``out [T, H, D]`` the causal attention of ``q [T, H, D]``: sequence ``s``
    owns the ``query_len[s]`` query tokens from ``query_start[s]`` on (so any subset of a batch's
    sequences can be passed), the last at position ``seq_lens[s] - 1``, and each attends to the cached keys from position ``kv_start`` (a
    multiple of the block size) up to its own. ``lse [T, H]`` (float32), when given, receives
    each row's log-sum-exp of scores, for merging with attention over positions before
    ``kv_start``."""
    lib = load()
    if lib is None:
        raise RuntimeError("native attention kernel is not available")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name}: heads and head_dim must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: must be contiguous")
    if block_tables.dtype != torch.int64 or block_tables.stride(1) != 1:
        raise ValueError("block_tables: must be int64 with contiguous rows")
    for name, t in (("seq_lens", seq_lens), ("query_start", query_start), ("query_len", query_len)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (num_seqs,):
            raise ValueError(f"{name}: must be a contiguous int64 tensor [num_seqs]")
    if lse is not None and (
        lse.dtype != torch.float32 or not lse.is_contiguous() or lse.shape != q.shape[:2]
    ):
        raise ValueError("lse: must be a contiguous float32 tensor [num_tokens, num_heads]")
    dtype = DTYPE_CODES.get(q.dtype)
    if dtype is None or not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
        raise ValueError(f"dtype: float32 or bfloat16 everywhere, got {q.dtype}")
    rc = lib.paged_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        query_start.data_ptr(),
        query_len.data_ptr(),
        out.data_ptr(),
        lse.data_ptr() if lse is not None else None,
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.stride(0),
        q.stride(0),
        out.stride(0),
        kv_start,
        scale,
        dtype,
        torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError("paged_attention: out of memory")
    if rc != 0:
        raise ValueError(
            "paged_attention: unsupported shape (at most 16 query heads per KV head, head_dim "
            "at most 256, kv_start a multiple of the block size)"
        )


def merge_attention(
    a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor
) -> None:
    """Combine two attentions of the same rows over disjoint keys, weighting each by its share
    of the softmax mass: ``a [Hkv, T * group, D]`` with ``lse_a [Hkv, T * group]`` (per KV head,
    the group's query rows stacked, as SDPA returns them for ``q.view(T, Hkv, group, D)``
    permuted to ``[Hkv, T, group, D]``), and ``b``/``out [T, H, D]`` with ``lse_b [T, H]``."""
    lib = load()
    if lib is None:
        raise RuntimeError("native attention kernel is not available")
    num_tokens, num_heads, head_dim = b.shape
    num_kv_heads = a.shape[0]
    if not (a.is_contiguous() and lse_a.is_contiguous() and lse_b.is_contiguous()):
        raise ValueError("a, lse_a, lse_b: must be contiguous")
    if a.shape != (num_kv_heads, num_tokens * (num_heads // num_kv_heads), head_dim):
        raise ValueError(f"a: shape {tuple(a.shape)} does not match b {tuple(b.shape)}")
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise ValueError("lse_a, lse_b: must be float32")
    for name, t in (("b", b), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name}: heads and head_dim must be contiguous")
    dtype = DTYPE_CODES.get(b.dtype)
    if dtype is None or not (a.dtype == b.dtype == out.dtype):
        raise ValueError(f"dtype: float32 or bfloat16 everywhere, got {b.dtype}")
    lib.merge_attention(
        a.data_ptr(),
        lse_a.data_ptr(),
        b.data_ptr(),
        lse_b.data_ptr(),
        out.data_ptr(),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        b.stride(0),
        out.stride(0),
        dtype,
        torch.get_num_threads(),
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Copy the rows of ``k``/``v [T, Hkv, D]`` into cache slots ``slot_mapping [T]`` (one call,
    no dispatch per layer of ``index_copy_``). Returns False, doing nothing, for layouts it does
    not handle (rows with gaps between heads, another dtype, no library): the caller falls
    back."""
    lib = load()
    if lib is None or k.dtype not in DTYPE_CODES or k.dtype != k_cache.dtype:
        return False
    if v.dtype != k.dtype or v_cache.dtype != k.dtype or slot_mapping.dtype != torch.int64:
        return False
    row = k_cache.shape[2] * k_cache.shape[3]
    for t in (k, v):
        if (
            t.dim() != 3
            or t.stride(2) != 1
            or t.stride(1) != t.shape[2]
            or t.shape[1:] != k_cache.shape[2:]
        ):
            return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()):
        return False
    lib.write_kv_cache(
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        k.shape[0],
        row,
        k.stride(0),
        v.stride(0),
        k.element_size(),
        torch.get_num_threads(),
    )
    return True
