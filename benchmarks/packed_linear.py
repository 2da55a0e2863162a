"""This model's four linear shapes through oneDNN's packed kernel (an MLP's gate and up followed
by the ``silu_mul`` pass) and through the packed tiles' kernel that ``linear`` picks for bf16
(``native.decode_linear``: on AMX, ``csrc/amx_prefill_linear.c`` past a decode step's rows), side
by side in one process:

    python -m benchmarks.packed_linear --rows 128,544,1172,2000

Prints milliseconds per call (median of ``--repeat``), oneDNN / tiles, for ``--rounds`` rounds
that take turns shape by shape, and the four shapes' sum per round. The weights and rows stay in
cache between calls, as a prefill step's do within one linear.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.vllm_gemm import median_s
from engine.kernels import native
from engine.model import fused
from engine.model.linear import pack_weight

# (in_features, out_features, gated) of SmolLM2-135M's fused qkv, o, gate/up and down.
SHAPES = {
    "qkv": (576, 960, False),
    "o": (576, 576, False),
    "gate_up": (576, 3072, True),
    "down": (1536, 576, False),
}


def pair(rows: int, k: int, n: int, gated: bool) -> tuple[Callable[[], object], ...]:
    """(oneDNN, tiles) callables for one shape at ``rows`` rows."""
    gen = torch.Generator().manual_seed(rows + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    packed = pack_weight(weight, gated)
    if packed is None or packed.onednn is None or packed.decode is None:
        raise SystemExit("needs oneDNN's packed linear and a decode linear kernel (bf16)")
    onednn, tiles = packed.onednn, packed.decode

    def one() -> object:
        y = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
        return fused.silu_mul(y) if gated else y

    def ours() -> object:
        return native.decode_linear(x, tiles, n, gated, packed.kind)

    return one, ours


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="128,544,1172,2000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"kernel: {native.decode_linear_kind()}, threads={torch.get_num_threads()}")
    for rows in (int(r) for r in args.rows.split(",")):
        calls = {name: pair(rows, k, n, g) for name, (k, n, g) in SHAPES.items()}
        sums = [[0.0, 0.0] for _ in range(args.rounds)]
        cells: dict[str, list[str]] = {name: [] for name in SHAPES}
        for r in range(args.rounds):
            for name, (one, ours) in calls.items():
                a, b = median_s(one, args.repeat) * 1e3, median_s(ours, args.repeat) * 1e3
                sums[r][0] += a
                sums[r][1] += b
                cells[name].append(f"{a:.3f} / {b:.3f}")
        print(f"{rows} rows (ms per call, oneDNN / tiles):")
        for name, row in cells.items():
            print(f"  {name:8s} {'   '.join(row)}")
        print(f"  {'sum':8s} {'   '.join(f'{a:.3f} / {b:.3f}' for a, b in sums)}")


if __name__ == "__main__":
    main()
