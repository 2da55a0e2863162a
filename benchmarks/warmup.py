"""Time to first token of the first requests after start, with and without the warm-up.

    python -m benchmarks.warmup

Builds an engine (offline, on this thread), optionally runs ``engine.warmup.warm_up``, then
serves ``--requests`` requests one after another, each alone: a prompt of ``--prompt`` tokens
and one output token, so the time is the request's prefill and first sampling. Prints each
request's time and the first's against the median of the rest, once without and once with the
warm-up (a fresh engine each, in a fresh process where ``--fresh`` is given, since the kernel
library and oneDNN's caches live as long as the process).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

import torch

from engine import LLM, SamplingParams
from engine.warmup import warm_up


def first_requests(args: argparse.Namespace, warm: bool) -> tuple[float, list[float]]:
    """Seconds of the warm-up (0 without) and of each request, in order."""
    llm = LLM(model=args.model, dtype=args.dtype)
    engine = llm.engine
    vocab = engine.model_cfg.vocab_size
    warmup_s = warm_up(engine).seconds if warm else 0.0
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i in range(args.requests):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt)]
        start = time.perf_counter()
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return warmup_s, times


def report(label: str, warmup_s: float, times: list[float]) -> None:
    rest = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(
        f"{label:<15} warm-up {warmup_s * 1000:7.0f} ms; first {times[0] * 1000:6.1f} ms, "
        f"median of the rest {rest * 1000:6.1f} ms ({times[0] / rest:.2f}x), tenth "
        f"{times[min(9, len(times) - 1)] * 1000:6.1f} ms"
    )
    print("  each (ms): " + " ".join(f"{t * 1000:.1f}" for t in times))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh", action="store_true", help="each case in a new process")
    ap.add_argument("--only", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [args.only] if args.only else ["cold", "warm"]
    for case in cases:
        if args.fresh and not args.only:
            rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--fresh"]
            subprocess.run(
                [sys.executable, "-m", "benchmarks.warmup", *rest, "--only", case], check=True
            )
            continue
        warmup_s, times = first_requests(args, warm=case == "warm")
        report("without warm-up" if case == "cold" else "with warm-up", warmup_s, times)


if __name__ == "__main__":
    main()
