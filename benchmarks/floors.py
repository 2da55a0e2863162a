"""What this CPU can do at best: memory bandwidth and matmul rates, and the per-step floors they
imply for the default model.

    python -m benchmarks.floors [--threads 2]

* read bandwidth: ``sum`` over a 512 MiB float32 tensor (far beyond the caches);
* matmul rate: this model's layer shapes (qkv, o, gate_up, down) at 2048 and 64 rows, bf16
  through the same oneDNN-packed path the engine uses, fp32 through ``F.linear`` (MKL).

A decode step at batch ``B`` reads every weight once (bytes / bandwidth) and does
``2 * params * B`` FLOPs (FLOPs / rate); the larger of the two is its floor.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.model.linear import linear, pack_weight

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
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
