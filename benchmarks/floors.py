"""What this CPU can do at best: memory bandwidth and matmul rates, and the per-step floors they
imply for the default model.

    python -m benchmarks.floors [--threads 2]

* read bandwidth: ``sum`` over a 512 MiB float32 tensor (far beyond the caches);
* matmul rate: this model's layer shapes (qkv, o, gate_up, down) at 2048 and 64 rows, bf16
  through the same oneDNN-packed path the engine uses, fp32 through the path ``linear`` picks;
* fp32 kernels: MKL's sgemm (``F.linear``), oneDNN's packed kernel and this project's AVX2
  kernel (``csrc/f32_linear.c``, where built) at 1 to 2048 rows, over 8 layers' distinct weights
  (113 MB, beyond the caches), which decide ``linear.FP32_PACKED_ROWS`` for this CPU's vendor
  and ``native.f32_linear_preferred``;
* bf16 kernels: torch's bf16 ``F.linear`` against ``upcast_linear`` (the weight widened to float32
  a slice at a time) at 1 to 2048 rows, 8 layers, which decides ``linear.BF16_EMULATED_MAX_ROWS``
  on a CPU without native bf16 (on one with it, ``linear`` takes neither: it packs for oneDNN).

A decode step at batch ``B`` reads every weight once (bytes / bandwidth) and does
``2 * params * B`` FLOPs (FLOPs / rate); the larger of the two is its floor.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from engine.cpuinfo import cpu_has_bf16, cpu_vendor
from engine.kernels import native
from engine.model.linear import (
    FP32_PACKED_ROWS,
    _onednn_pack,
    linear,
    pack_weight,
    upcast_linear,
)

# SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536, 30 layers, vocab 49152.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def best_of(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_bandwidth(mib: int = 512, repeat: int = 5) -> float:
    x = torch.ones(mib * (1 << 20) // 4)
    return x.numel() * 4 / best_of(x.sum, repeat) / 1e9


def matmul_rate(dtype: torch.dtype, rows: int, repeat: int = 5) -> float:
    """GFLOP/s over one layer's four linears at ``rows`` rows."""
    total, flops = 0.0, 0
    for n, k in LAYER_SHAPES:
        x = torch.randn(rows, k).to(dtype)
        w = torch.randn(n, k).to(dtype)
        packed = pack_weight(w)
        total += best_of(lambda x=x, w=w, p=packed: linear(x, w, None, p), repeat)
        flops += 2 * rows * n * k
    return flops / total / 1e9


def fp32_kernels(rows: int, layers: int = 8, repeat: int = 3) -> dict[str, float]:
    """ms for ``layers`` layers' four linears at ``rows`` rows: MKL, oneDNN packed, and this
    project's AVX2 kernel (``csrc/f32_linear.c``) where it is built; whichever exist here."""
    weights = [torch.randn(n, k) * 0.02 for _ in range(layers) for n, k in LAYER_SHAPES]
    xs = {k: torch.randn(rows, k) for _, k in LAYER_SHAPES}

    def mkl() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    out = {"mkl_ms": round(best_of(mkl, repeat) * 1e3, 2)}
    onednn = [_onednn_pack(w) for w in weights]
    if all(p is not None for p in onednn):

        def packed() -> None:
            for w, p in zip(weights, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        out["onednn_ms"] = round(best_of(packed, repeat) * 1e3, 2)
    panels = [native.f32_pack_weight(w) for w in weights]
    if all(p is not None for p in panels):

        def kernel() -> None:
            for w, p in zip(weights, panels, strict=True):
                native.f32_linear(xs[w.shape[1]], p, w.shape[0])

        out["f32_kernel_ms"] = round(best_of(kernel, repeat) * 1e3, 2)
    return out


def bf16_kernels(rows: int, layers: int = 8, repeat: int = 3) -> dict[str, float]:
    """ms for ``layers`` layers' four linears at ``rows`` bf16 rows: torch's bf16 kernel vs the
    weight widened to float32 slice by slice (the emulated kernel is skipped past 512 rows, where
    one call takes seconds)."""
    weights = [
        (torch.randn(n, k) * 0.02).bfloat16() for _ in range(layers) for n, k in LAYER_SHAPES
    ]
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in LAYER_SHAPES}

    def direct() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def widened() -> None:
        for w in weights:
            upcast_linear(xs[w.shape[1]], w)

    out = {"widened_ms": round(best_of(widened, repeat) * 1e3, 2)}
    if rows <= 512:
        out["bf16_ms"] = round(best_of(direct, repeat) * 1e3, 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = LAYERS * sum(n * k for n, k in LAYER_SHAPES) + VOCAB * HIDDEN  # LM head included
    out: dict = {"threads": torch.get_num_threads(), "params": params}
    out["read_GBps"] = round(read_bandwidth(), 2)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for rows in (2048, 64, 1):
            out[f"{name}_gflops_rows{rows}"] = round(matmul_rate(dtype, rows), 1)
        size = 2 if dtype == torch.bfloat16 else 4
        mem_ms = params * size / (out["read_GBps"] * 1e9) * 1e3
        for batch in (1, 64):
            flop_ms = 2 * params * batch / (out[f"{name}_gflops_rows{batch}"] * 1e9) * 1e3
            out[f"{name}_floor_ms_batch{batch}"] = {
                "weights_read_ms": round(mem_ms, 1),
                "flops_ms": round(flop_ms, 1),
                "max_tok_s": round(batch / max(mem_ms, flop_ms) * 1e3),
            }
    out["cpu_vendor"] = cpu_vendor()
    out["fp32_packed_rows"] = f"{FP32_PACKED_ROWS.start}..{FP32_PACKED_ROWS.stop - 1}"
    out["fp32_kernel_preferred"] = native.f32_linear_preferred()
    out["fp32_kernels_8_layers"] = {
        rows: fp32_kernels(rows) for rows in (1, 2, 4, 8, 32, 64, 512, 2048)
    }
    out["native_bf16"] = cpu_has_bf16()
    out["bf16_kernels_8_layers"] = {
        rows: bf16_kernels(rows) for rows in (1, 2, 4, 5, 8, 64, 512, 2048)
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
