"""Offline throughput: our engine (``engine.LLM``) vs transformers' static batching.

    python -m benchmarks.offline                      # W1 in bf16 and fp32, plus transformers
    python -m benchmarks.offline --workload all       # W1, batch-1 decode latency and W2
    python -m benchmarks.offline --dtype bfloat16 --skip-hf --repeat 3
    python -m benchmarks.offline --dtype float32 --skip-hf --sampling-opt repetition_penalty=1.1

Every run is greedy with ``ignore_eos`` so each request produces exactly ``max_tokens`` tokens.
Prints output tokens/s per run (best and median over ``--repeat``), the ratios, and one JSON line
prefixed with ``SUMMARY`` for scripts.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks import engine_workloads as wl

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class Timing:
    """Seconds per repeat of one benchmark; ``tokens`` output tokens each."""

    tokens: int
    seconds: list[float] = field(default_factory=list)
    # CPU seconds of this process per repeat: less sensitive than wall time to other processes
    # on a shared machine (threads spinning at barriers still count).
    cpu_seconds: list[float] = field(default_factory=list)

    @property
    def best_tps(self) -> float:
        return self.tokens / min(self.seconds)

    @property
    def median_tps(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    def summary(self) -> dict[str, Any]:
        return {
            "tok_s_best": round(self.best_tps, 1),
            "tok_s_median": round(self.median_tps, 1),
            "seconds": [round(s, 3) for s in self.seconds],
            "tok_per_cpu_s_best": round(self.tokens / min(self.cpu_seconds), 1)
            if self.cpu_seconds
            else None,
        }


def greedy(max_tokens: int, **options: Any) -> Any:
    """Greedy with ``ignore_eos``; ``options`` are further SamplingParams fields (penalties)."""
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **options)


def make_llm(model: str, dtype: str, prefix_caching: bool, extra: dict[str, Any]) -> Any:
    from engine import LLM

    return LLM(model=model, dtype=dtype, enable_prefix_caching=prefix_caching, **extra)


def run_ours(
    llm: Any, workload: wl.Workload, repeat: int, sampling: dict[str, Any] | None = None
) -> Timing:
    """Time ``llm.generate`` on the workload. With prefix caching, the cache is reset between
    repeats by a fresh salt so every repeat pays for the shared prefix once."""
    timing = Timing(workload.num_output_tokens)
    params = greedy(workload.max_tokens, **(sampling or {}))
    for _ in range(repeat):
        reset_prefix_cache(llm)
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(workload.prompts, params)
        timing.seconds.append(time.perf_counter() - start)
        timing.cpu_seconds.append(time.process_time() - cpu)
        produced = sum(len(o.token_ids) for o in outs)
        if produced != workload.num_output_tokens:
            raise RuntimeError(f"expected {workload.num_output_tokens} tokens, got {produced}")
    return timing


def reset_prefix_cache(llm: Any) -> None:
    """Forget every cached block hash so a repeat starts cold (the pool must be idle)."""
    pool = llm.engine.kv.pool
    if pool.num_free_blocks != pool.num_blocks:
        raise RuntimeError("reset_prefix_cache: blocks still in use")
    reset = getattr(pool, "reset_prefix_cache", None)
    if reset is not None:
        reset()
        return
    # A unique salt per repeat makes every earlier hash unreachable.
    llm.engine.kv_namespace = f"{llm.engine.kv_namespace}#{time.perf_counter_ns()}"


def run_batch1(llm: Any, repeat: int, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """ms per output token after the first, from ``t(128 tokens) - t(1 token)``."""
    work = wl.batch1()
    full, first = [], []
    for _ in range(repeat):
        for max_tokens, sink in ((1, first), (work.max_tokens, full)):
            start = time.perf_counter()
            llm.generate(work.prompts, greedy(max_tokens, **(sampling or {})))
            sink.append(time.perf_counter() - start)
    per_token = [(f - min(first)) / (work.max_tokens - 1) * 1000 for f in full]
    return {
        "ms_per_token_best": round(min(per_token), 2),
        "ms_per_token_median": round(statistics.median(per_token), 2),
        "ttft_ms_best": round(min(first) * 1000, 1),
    }


def run_hf(
    model_dir: str, dtype: torch.dtype, workload: wl.Workload, batch: int, repeat: int
) -> Timing:
    """transformers ``generate`` with static batches of ``batch`` left-padded prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0
    batches = []
    for i in range(0, len(workload.prompts), batch):
        group = workload.prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        batches.append((ids, mask))
    timing = Timing(workload.num_output_tokens)
    with torch.inference_mode():
        model.generate(
            batches[0][0][:2, -8:],
            attention_mask=batches[0][1][:2, -8:],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
        for _ in range(repeat):
            start, cpu = time.perf_counter(), time.process_time()
            produced = 0
            for ids, mask in batches:
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=workload.max_tokens,
                    min_new_tokens=workload.max_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
                produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
            timing.seconds.append(time.perf_counter() - start)
            timing.cpu_seconds.append(time.process_time() - cpu)
            if produced != workload.num_output_tokens:
                raise RuntimeError(f"transformers produced {produced} tokens")
    return timing


def parse_engine_opts(options: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags (``--engine-opt``, ``--sampling-opt``) as keyword arguments; a value
    is read as JSON when it parses (numbers, booleans, objects), else kept as a string."""
    extra: dict[str, Any] = {}
    for opt in options:
        key, _, value = opt.partition("=")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def serve(model_dir: str, dtype: str, extra: dict[str, Any], args: Any) -> None:
    """Keep an engine per prefix-caching setting loaded and time one workload per stdin line."""
    llms: dict[bool, Any] = {}

    def generate(work: wl.Workload, max_tokens: int) -> float:
        if work.prefix_caching not in llms:
            llm = make_llm(model_dir, dtype, work.prefix_caching, extra)
            llm.generate(wl.warmup().prompts, greedy(wl.warmup().max_tokens))
            llms[work.prefix_caching] = llm
        llm = llms[work.prefix_caching]
        reset_prefix_cache(llm)
        start = time.perf_counter()
        outs = llm.generate(work.prompts, greedy(max_tokens))
        elapsed = time.perf_counter() - start
        if sum(len(o.token_ids) for o in outs) != len(work.prompts) * max_tokens:
            raise RuntimeError("a request stopped early")
        return elapsed

    for caching in (False, True):
        generate(wl.Workload("load", wl.warmup().prompts, 1, caching), 1)
    wl.serve_commands(generate, args.num_prompts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "both"], default="both")
    ap.add_argument("--workload", choices=["w1", "w2", "batch1", "all"], default="w1")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers' static batching")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra EngineConfig option (repeatable), value parsed as JSON when possible",
    )
    ap.add_argument(
        "--sampling-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra SamplingParams field for our engine (repeatable), e.g. repetition_penalty=1.1",
    )
    ap.add_argument(
        "--serve",
        action="store_true",
        help="stay loaded (one --dtype) and run workloads named on stdin, for compare_vllm",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    extra = parse_engine_opts(args.engine_opt)
    sampling = parse_engine_opts(args.sampling_opt)

    from engine.model.loader import resolve_model

    model_dir = str(resolve_model(args.model))
    if args.serve:
        serve(model_dir, "bfloat16" if args.dtype == "both" else args.dtype, extra, args)
        return {}
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    workloads = ["w1", "batch1", "w2"] if args.workload == "all" else [args.workload]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    results: dict[str, Any] = {
        "loadavg_start": load,
        "model": args.model,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "engine_opts": extra,
        "sampling_opts": sampling,
    }
    for dtype in dtypes:
        for name in workloads:
            key = f"{name}_{dtype}"
            caching = name == "w2"
            llm = make_llm(model_dir, dtype, caching, extra)
            llm.generate(wl.warmup().prompts, greedy(wl.warmup().max_tokens))
            if name == "batch1":
                results[key] = run_batch1(llm, args.repeat, sampling)
                print(
                    f"{key:>18}: {results[key]['ms_per_token_best']:.2f} ms/token (best), "
                    f"{results[key]['ms_per_token_median']:.2f} (median)",
                    flush=True,
                )
            else:
                work = wl.w1(args.num_prompts) if name == "w1" else wl.w2(args.num_prompts)
                timing = run_ours(llm, work, args.repeat, sampling)
                results[key] = timing.summary()
                print(
                    f"{key:>18}: {timing.best_tps:8.1f} tok/s best, {timing.median_tps:8.1f} median",
                    flush=True,
                )
            del llm
            gc.collect()
        if "w1" in workloads and not args.skip_hf:
            timing = run_hf(
                model_dir, DTYPES[dtype], wl.w1(args.num_prompts), args.hf_batch, args.repeat
            )
            key = f"hf_static_w1_{dtype}"
            results[key] = timing.summary()
            ratio = results[f"w1_{dtype}"]["tok_s_best"] / timing.best_tps
            results[f"ratio_vs_hf_{dtype}"] = round(ratio, 2)
            print(
                f"{key:>18}: {timing.best_tps:8.1f} tok/s best -> ours/hf = {ratio:.2f}x",
                flush=True,
            )
            gc.collect()
    print("SUMMARY " + json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
