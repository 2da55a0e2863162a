"""This model's four linear shapes through torch's oneDNN linear (what our engine calls) and
through vLLM's own oneDNN matmul, side by side in one process. Run with vLLM's interpreter (the
virtualenv ``benchmarks.compare_vllm`` installs):

    ~/.cache/prefixserve/vllm-venv/bin/python benchmarks/vllm_gemm.py --rows 544,2048

Prints milliseconds per call (median of ``--repeat``) per shape and their sum, three rounds per
row count, taking turns call by call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

# (in_features, out_features) of SmolLM2-135M's fused qkv, o, gate/up and down projections.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def median_s(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="544,2048")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    from vllm import _custom_ops as ops  # only in vLLM's virtualenv

    if args.threads:
        torch.set_num_threads(args.threads)
    for rows in (int(r) for r in args.rows.split(",")):
        for _ in range(args.rounds):
            parts, total_torch, total_vllm = [], 0.0, 0.0
            for name, (k, n) in SHAPES.items():
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                w = torch.randn(n, k, dtype=torch.bfloat16)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                handle = ops.create_onednn_mm(w.t(), 32)
                a = median_s(
                    lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""
                    ),
                    args.repeat,
                )
                b = median_s(lambda x=x, h=handle: ops.onednn_mm(h, x, None), args.repeat)
                total_torch, total_vllm = total_torch + a, total_vllm + b
                parts.append(f"{name} {a * 1e3:.2f} / {b * 1e3:.2f}")
            print(
                f"{rows} rows, ms torch / vLLM: {' | '.join(parts)} | sum "
                f"{total_torch * 1e3:.2f} / {total_vllm * 1e3:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
