"""Decode throughput on a GPU: our engine (CUDA graphs on and off) vs transformers ``generate``,
next to the decode-step floor of the same GPU.

    python -m benchmarks.gpu                          # smollm2-135m shape, ~4 minutes on an H100
    python -m benchmarks.gpu --shape llama-1b --out results.json
    python -m benchmarks.gpu --quick                  # ~1 minute: smaller workloads, 1 repeat
    python -m benchmarks.gpu --device cpu --quick --shape tiny   # smoke run without a GPU

The checkpoint has a real model's shape (``benchmarks.gpu_model.SHAPES``) and random weights; no
hub, no tokenizer: prompts are token ids. Workloads, all greedy with every sequence producing
exactly ``max_tokens`` tokens (``ignore_eos``; ``min_new_tokens`` for transformers):

* ``w1``: ``benchmarks.engine_workloads.w1``, 64 prompts of 64-128 tokens, 128 output tokens;
* ``long``: 16 prompts of 4096 tokens, 128 output tokens (decode over long contexts).

Per engine run: output tokens/s of the whole run, and ms per decode step as ``(t(N) - t(N/2)) /
(N/2)`` (a run to N tokens minus a run to N/2: the prefill, and the first steps where decodes
share steps with other prompts' prefill chunks, cancel), plus the engine's own moving average of
the time between decode steps. transformers runs the same prompts
as one left-padded batch. Each measurement is the median of ``--repeat`` runs after a warm-up;
the per-step difference takes the fastest of at least three runs of each length.
The floor (``gpu_model.decode_step_floor``) uses the bandwidth of a large device-to-device copy
and the launch cost of one tiny kernel (eager, and replayed inside a CUDA graph) times the kernels
one eager decode step runs, counted with the torch profiler.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import engine_workloads as wl
from benchmarks.gpu_model import SHAPES, Shape, build_checkpoint, decode_step_floor
from benchmarks.gpu_model import mean_context_lengths as mean_contexts


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


def workloads(vocab_size: int, quick: bool) -> list[Workload]:
    """W1 and the long-context decode workload (smaller with ``quick``), token ids folded into
    the vocabulary."""
    if quick:
        w1 = wl.w1(num_prompts=32, max_tokens=64)
        long_n, long_len, long_out = 4, 2048, 64
    else:
        w1 = wl.w1()
        long_n, long_len, long_out = 16, 4096, 128
    rng = random.Random(4)
    lo = min(wl.LOW_TOKEN, vocab_size // 4)
    long_prompts = [[rng.randrange(lo, vocab_size) for _ in range(long_len)] for _ in range(long_n)]
    w1_prompts = [[lo + t % (vocab_size - lo) for t in p] for p in w1.prompts]
    return [Workload("w1", w1_prompts, w1.max_tokens), Workload("long", long_prompts, long_out)]


# -- timing --------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


DIFF_ROUNDS = 3


def median_of(fn: Callable[[], Any], device: str, repeat: int) -> float:
    return statistics.median(timed(fn, device) for _ in range(repeat))


def copy_bandwidth_gbps(device: str, mib: int = 1024, repeat: int = 10) -> float:
    """GB/s of a large copy, counting bytes read and written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_of(lambda: dst.copy_(src), device, repeat)
    return 2 * src.numel() / seconds / 1e9


def launch_costs_us(n: int = 2000) -> dict[str, float]:
    """Microseconds per launch of a one-element kernel: issued from Python (eager), and replayed
    as one of ``n`` nodes of a CUDA graph."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    eager = timed(lambda: [x.add_(1) for _ in range(n)], "cuda") / n
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream of its own
        for _ in range(n):
            x.add_(1)
    graph.replay()
    replayed = median_of(graph.replay, "cuda", 5) / n
    return {"eager_us": round(eager * 1e6, 2), "graph_us": round(replayed * 1e6, 2)}


def count_gpu_ops(fn: Callable[[], Any]) -> int:
    """GPU kernels, copies and memsets that ``fn`` runs, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# -- our engine ----------------------------------------------------------------------------------
def supports_enforce_eager() -> bool:
    from engine.config import EngineConfig

    return "enforce_eager" in EngineConfig.__dataclass_fields__


def kv_blocks_for(work: Workload, block_size: int = 16) -> int:
    """KV blocks that hold every sequence of ``work`` to its end at once, plus some spare."""
    return sum(-(-(len(p) + work.max_tokens) // block_size) for p in work.prompts) + 64


def make_llm(
    model_dir: Path, args: argparse.Namespace, eager: bool | None, num_kv_blocks: int
) -> Any:
    from engine import LLM

    extra: dict[str, Any] = {} if eager is None else {"enforce_eager": eager}
    return LLM(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.backend,
        enable_prefix_caching=False,  # repeats would otherwise hit the cache
        num_kv_blocks=num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        **extra,
    )


def greedy(max_tokens: int) -> Any:
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_ours(llm: Any, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    def run(max_tokens: int) -> None:
        outs = llm.generate(work.prompts, greedy(max_tokens))
        assert all(len(o.token_ids) == max_tokens for o in outs)

    run(work.max_tokens)  # warm-up: every batch shape of this workload
    # The per-step figure is a difference of two runs, so one noisy run can turn it negative:
    # it takes the fastest of at least DIFF_ROUNDS runs of each length.
    rounds = max(args.repeat, DIFF_ROUNDS)
    fulls = [timed(lambda: run(work.max_tokens), args.device) for _ in range(rounds)]
    engine_step_s = llm.engine.stats.decode_step_s
    half = work.max_tokens // 2
    halves = [timed(lambda: run(half), args.device) for _ in range(rounds)]
    full = statistics.median(fulls)
    runner = llm.engine.runner
    return {
        "tok_s": round(work.num_output_tokens / full, 1),
        "seconds": round(full, 3),
        "decode_ms_per_step": round((min(fulls) - min(halves)) / (work.max_tokens - half) * 1e3, 3),
        "engine_decode_step_ms": round(engine_step_s * 1e3, 3) if engine_step_s else None,
        "graph_replays": getattr(runner, "graph_replays", None),
    }


def kernels_per_decode_step(llm: Any, work: Workload) -> int | None:
    """GPU ops of one eager decode step of the workload's batch: (ops of a run to 9 tokens - ops
    of a run to 1 token) / 8."""
    try:
        n = 9
        ops_full = count_gpu_ops(lambda: llm.generate(work.prompts, greedy(n)))
        ops_first = count_gpu_ops(lambda: llm.generate(work.prompts, greedy(1)))
    except Exception as exc:  # the profiler is a diagnostic: report and go on without it
        print(f"kernel count failed: {exc!r}")
        return None
    return round((ops_full - ops_first) / (n - 1))


# -- transformers ----------------------------------------------------------------------------------
def run_hf(model_dir: Path, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """``generate`` over the whole workload as one left-padded batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    width = max(len(p) for p in work.prompts)
    ids = torch.zeros(len(work.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)

    def run(max_new: int) -> None:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + max_new

    run(min(work.max_tokens, 8))
    seconds = median_of(lambda: run(work.max_tokens), args.device, args.repeat)
    return {"tok_s": round(work.num_output_tokens / seconds, 1), "seconds": round(seconds, 3)}


_STARTED = time.perf_counter()


def progress(row: dict[str, Any]) -> None:
    """Print a finished measurement at once, with the seconds since the module was loaded."""
    print(json.dumps(row | {"at_s": round(time.perf_counter() - _STARTED, 1)}), flush=True)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# -- the run ----------------------------------------------------------------------------------------
def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / (1 << 30), 1),
            "cuda": torch.version.cuda,
        }
    try:
        import transformers
        import triton

        env |= {"transformers": transformers.__version__, "triton": triton.__version__}
    except ImportError:
        pass
    return env


def measure_workload(
    args: argparse.Namespace,
    shape: Shape,
    model_dir: Path,
    work: Workload,
    modes: list[tuple[str, bool | None]],
    launch: dict[str, float] | None,
    bandwidth: float,
) -> list[dict[str, Any]]:
    """One row per engine mode and one for transformers; our rows carry the step floor and the
    speed-up over transformers."""
    rows: list[dict[str, Any]] = []
    kernels = None
    for mode, eager in modes:
        row: dict[str, Any] = {"workload": work.name, "engine": f"ours-{mode}"}
        try:
            llm = make_llm(model_dir, args, eager, kv_blocks_for(work))
            row |= run_ours(llm, work, args)
            if launch is not None and mode == "eager":
                kernels = kernels_per_decode_step(llm, work)
            del llm
        except Exception as exc:  # one failed measurement must not lose the others
            traceback.print_exc()
            row["error"] = repr(exc)
        free_memory(args.device)
        rows.append(row)
        progress(row)
    hf: dict[str, Any] | None = None
    if not args.skip_hf:
        hf = {"workload": work.name, "engine": "transformers"}
        try:
            hf |= run_hf(model_dir, work, args)
        except Exception as exc:
            traceback.print_exc()
            hf["error"] = repr(exc)
        free_memory(args.device)
        progress(hf)
    contexts = mean_contexts([len(p) for p in work.prompts], work.max_tokens)
    for row, (mode, _) in zip(rows, modes, strict=True):
        if "tok_s" not in row:
            continue
        launch_us = launch["graph_us" if mode == "graphs" else "eager_us"] if launch else None
        floor = decode_step_floor(shape, args.dtype, contexts, bandwidth, kernels, launch_us)
        row |= {
            "kernels_per_step": kernels,
            "floor_ms": round(floor.total_ms, 3),
            "floor_memory_ms": round(floor.memory_ms, 3),
            "floor_launch_ms": None if floor.launch_ms is None else round(floor.launch_ms, 3),
            "floor_weight_MB": round(floor.weight_bytes / 1e6, 1),
            "floor_kv_MB": round(floor.kv_bytes / 1e6, 1),
        }
        if hf is not None and "tok_s" in hf:
            # Significant digits, not decimals: on CPU smoke runs the ratio is ~0.04.
            row["x_transformers"] = float(f"{row['tok_s'] / hf['tok_s']:.4g}")
    return rows + ([hf] if hf else [])


def measure(args: argparse.Namespace, shape: Shape, model_dir: Path) -> dict[str, Any]:
    cuda = args.device == "cuda"
    out: dict[str, Any] = {"env": environment(args.device), "shape": args.shape}
    out["shape_dims"] = shape.__dict__ | {"params": shape.num_params()}
    out["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    bw = copy_bandwidth_gbps(args.device, 1024 if cuda else 64)
    out["copy_bandwidth_GBps"] = round(bw, 1)
    out["launch"] = launch_costs_us() if cuda else None
    print(json.dumps({k: out[k] for k in ("env", "copy_bandwidth_GBps", "launch")}))

    # Graphs need CUDA and an engine that has the option; else one eager mode.
    modes: list[tuple[str, bool | None]] = [("eager", True if supports_enforce_eager() else None)]
    if cuda and supports_enforce_eager():
        modes.insert(0, ("graphs", False))
    elif cuda:
        print("this engine has no enforce_eager option: CUDA graphs not measured")

    rows: list[dict[str, Any]] = []
    for work in workloads(shape.vocab_size, args.quick):
        if args.workload in ("all", work.name):
            rows += measure_workload(args, shape, model_dir, work, modes, out["launch"], bw)
    out["results"] = rows
    return out


def print_table(out: dict[str, Any]) -> None:
    env = out["env"]
    print(
        f"\n{out['shape']} on {env.get('gpu', env['device'])} (torch {env['torch']}), "
        f"copy bandwidth {out['copy_bandwidth_GBps']} GB/s, launch {out['launch']}"
    )
    cols = [
        ("workload", 8),
        ("engine", 13),
        ("tok_s", 10),
        ("x_transformers", 8),
        ("decode_ms_per_step", 10),
        ("engine_decode_step_ms", 10),
        ("floor_ms", 9),
        ("floor_memory_ms", 9),
        ("floor_launch_ms", 9),
        ("kernels_per_step", 8),
        ("graph_replays", 8),
    ]
    heads = [
        "workload",
        "engine",
        "tok/s",
        "x HF",
        "ms/step",
        "eng ms",
        "floor",
        "mem",
        "launch",
        "kernels",
        "replays",
    ]
    print("  ".join(h.rjust(w) for h, (_, w) in zip(heads, cols, strict=True)))
    for row in out["results"]:
        cells = [str(row.get(k, "")) if row.get(k) is not None else "-" for k, _ in cols]
        line = "  ".join(c.rjust(w) for c, (_, w) in zip(cells, cols, strict=True))
        print(line + (f"  FAILED: {row['error']}" if "error" in row else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--backend", default="flash", help="engine attention_backend (cpu: torch)")
    ap.add_argument("--quick", action="store_true", help="smaller workloads, one repeat")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workload", choices=["all", "w1", "long"], default="all")
    ap.add_argument("--max-model-len", type=int, default=4608)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
    if args.device == "cpu" and args.backend == "flash":
        args.backend = "torch"
    if args.quick:
        args.repeat = 1
    shape = SHAPES[args.shape]
    args.max_model_len = min(args.max_model_len, shape.max_position_embeddings)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        model_dir = build_checkpoint(shape, Path(tmp), args.dtype, args.device)
        out = measure(args, shape, model_dir)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print_table(out)
    print(f"total {out['wall_s']} s")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
