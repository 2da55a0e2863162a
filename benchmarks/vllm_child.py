"""Runs the offline workloads through vLLM's Python API. Executed by ``benchmarks.compare_vllm``
with vLLM's own virtualenv's interpreter (it must not import torch from this project's venv, nor
the engine). Prints one line ``RESULT {json}``, or with ``--serve`` stays loaded and runs the
workloads named on stdin one at a time (``engine_workloads.serve_commands``).

    <vllm-venv>/bin/python benchmarks/vllm_child.py --model-dir DIR --dtype bfloat16 \
        --workloads w1,batch1,w2 --num-prompts 64 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import engine_workloads as wl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads", default="w1,batch1,w2")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--serve", action="store_true", help="stay loaded and run workloads named on stdin"
    )
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=args.model_dir,
        dtype=args.dtype,
        seed=0,
        max_model_len=2048,
        max_num_seqs=64,
        enable_prefix_caching=True,
        enforce_eager=args.enforce_eager,
    )
    result: dict = {"startup_s": round(time.perf_counter() - start, 1), "dtype": args.dtype}

    def run(work: wl.Workload, max_tokens: int | None = None) -> float:
        params = SamplingParams(
            max_tokens=max_tokens or work.max_tokens, temperature=0.0, ignore_eos=True
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
        # Every repeat starts with a cold prefix cache (W1 prompts would otherwise hit).
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = len(work.prompts) * (max_tokens or work.max_tokens)
        if produced != expected:
            raise RuntimeError(f"vLLM produced {produced} tokens, expected {expected}")
        return elapsed

    run(wl.warmup())
    if args.serve:
        wl.serve_commands(run, args.num_prompts)
        return
    for name in args.workloads.split(","):
        if name == "batch1":
            work = wl.batch1()
            first = [run(work, 1) for _ in range(args.repeat)]
            full = [run(work) for _ in range(args.repeat)]
            per_token = [(f - min(first)) / (work.max_tokens - 1) * 1000 for f in full]
            result["batch1"] = {
                "ms_per_token_best": round(min(per_token), 2),
                "ms_per_token_median": round(statistics.median(per_token), 2),
                "ttft_ms_best": round(min(first) * 1000, 1),
            }
        elif name == "wave":
            ms = [run(wl.wave()) * 1000 for _ in range(args.repeat)]
            result["wave"] = {
                "wave_ms_best": round(min(ms), 1),
                "wave_ms_median": round(statistics.median(ms), 1),
            }
        else:
            work = wl.w1(args.num_prompts) if name == "w1" else wl.w2(args.num_prompts)
            seconds = [run(work) for _ in range(args.repeat)]
            result[name] = {
                "tok_s_best": round(work.num_output_tokens / min(seconds), 1),
                "tok_s_median": round(work.num_output_tokens / statistics.median(seconds), 1),
                "seconds": [round(s, 3) for s in seconds],
            }
        print(f"vllm {name} {args.dtype}: {result[name]}", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
