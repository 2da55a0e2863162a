"""W1 with every ``--every``-th request constrained by a JSON schema, against W1 unconstrained.

    python -m benchmarks.structured_output --dtype bfloat16 --threads 2 --repeat 3

Same prompts, greedy, ``ignore_eos``, ``max_tokens`` 128 in both runs. The schema (an object
holding an array of exactly 100 small integers) needs more than 128 tokens to complete, so a
constrained request also ends at 128 tokens: both runs produce the same number of tokens in
batches of the same size, and the difference is the cost of the masks and grammar advances.
Runs alternate (unconstrained, constrained, ...) so drifting machine load hits both alike.
On a shared machine whole-run throughput swings with other work, so the run also times the
masking itself (``engine.sampler.apply_token_masks``, wrapped here): its share of each
constrained run's wall time is the slowdown every row of those steps paid.
Prints output tokens/s per run and one ``SUMMARY`` JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import engine.sampler
from benchmarks import engine_workloads as wl
from benchmarks.offline import greedy, make_llm

SCHEMA = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 100,
            "maxItems": 100,
        }
    },
    "required": ["readings"],
    "additionalProperties": False,
}


class MaskTimer:
    """Seconds spent applying grammar masks, and how many batches were masked."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._inner = engine.sampler.apply_token_masks

    def __call__(self, *args: Any) -> None:
        start = time.perf_counter()
        self._inner(*args)
        self.seconds += time.perf_counter() - start
        self.calls += 1


def timed(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, float, list]:
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, time.process_time() - cpu, outs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--every", type=int, default=4, help="constrain request i when i %% every == 0")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.model.loader import resolve_model
    from engine.structured_output import StructuredOutputs

    llm = make_llm(str(resolve_model(args.model)), args.dtype, False, {})
    llm.generate(wl.warmup().prompts, greedy(wl.warmup().max_tokens))
    work = wl.w1(args.num_prompts)
    plain = [greedy(work.max_tokens)] * len(work.prompts)
    spec = StructuredOutputs(json=SCHEMA)
    mixed = [
        greedy(work.max_tokens, structured_outputs=spec) if i % args.every == 0 else p
        for i, p in enumerate(plain)
    ]
    runs: dict[str, list[tuple[float, float]]] = {"none": [], "json_schema": []}
    timer = MaskTimer()
    engine.sampler.apply_token_masks = timer
    mask_shares: list[float] = []
    steps = []
    for _ in range(args.repeat):
        for name, params in (("none", plain), ("json_schema", mixed)):
            before, calls, num_steps = timer.seconds, timer.calls, llm.engine.stats.num_steps
            wall, cpu, outs = timed(llm, work.prompts, params)
            if name == "json_schema":
                mask_shares.append((timer.seconds - before) / wall)
                steps.append(
                    (
                        llm.engine.stats.num_steps - num_steps,
                        timer.calls - calls,
                        wall,
                        timer.seconds - before,
                    )
                )
            if sum(len(o.token_ids) for o in outs) != work.num_output_tokens:
                raise RuntimeError(f"{name}: a request stopped before max_tokens")
            for o, p in zip(outs, params, strict=True):
                if p.structured_outputs is not None:
                    # Truncated at max_tokens, the document so far is a prefix of valid JSON.
                    assert o.text.startswith('{"readings":['), o.text[:40]
            runs[name].append((wall, cpu))
            print(f"{name:>12}: {work.num_output_tokens / wall:8.1f} tok/s", flush=True)
    results: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "constrained_every": args.every,
    }
    for name, timings in runs.items():
        walls = [w for w, _ in timings]
        results[name] = {
            "tok_s_best": round(work.num_output_tokens / min(walls), 1),
            "tok_s_median": round(work.num_output_tokens / statistics.median(walls), 1),
            "tok_per_cpu_s_best": round(work.num_output_tokens / min(c for _, c in timings), 1),
        }
    ratio = results["json_schema"]["tok_s_median"] / results["none"]["tok_s_median"]
    results["median_ratio"] = round(ratio, 3)
    results["mask_share_of_wall"] = [round(x, 4) for x in mask_shares]
    results["ms_per_step"] = [round(1000 * w / n, 2) for n, _, w, _ in steps]
    results["mask_ms_per_masked_step"] = [round(1000 * m / c, 3) for _, c, _, m in steps if c]
    print(f"json_schema / none (median): {ratio:.3f}", flush=True)
    print(
        f"masking: {100 * max(mask_shares):.2f}% of a constrained run's wall time at most; "
        f"{results['mask_ms_per_masked_step']} ms per masked step, "
        f"steps of {results['ms_per_step']} ms",
        flush=True,
    )
    print("SUMMARY " + json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
