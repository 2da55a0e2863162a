"""What a thread running Python beside the engine costs its steps, per GIL switch interval.

    python -m benchmarks.gil_convoy                       # 5, 1 and 0.2 ms; 2 rounds each
    python -m benchmarks.gil_convoy --intervals 5,0.2 --rounds 3

Loads the engine (bf16 by default, prefix caching off), then for each interval
(``sys.setswitchinterval``), first with no other thread and then with a thread that runs pure
Python without pause (the stand-in for an event loop or worker thread busy in Python), times a
prefill step of 20 prompts of 100 tokens and a decode step of 32 sequences (the median of 16
steps, each timed on its own). Prints one line per setting with the medians over the rounds.
Not a throughput figure: the spinning thread also takes a core from the engine's two OpenMP
threads, which no interval changes (docs/performance.md, "The GIL hand-off").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

from engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--intervals", default="5,1,0.2", help="switch intervals in ms")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    rng = random.Random(0)
    high = min(40_000, llm.engine.model_cfg.vocab_size)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(high // 8, high) for _ in range(length)] for _ in range(n)]

    def timed(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch, params)
        return time.perf_counter() - start

    def decode_step(batch: list[list[int]], steps: int = 16) -> float:
        """The median of ``steps`` decode steps, each timed alone after the batch's prefill
        (timing each step keeps the figure positive whatever the machine's load)."""
        engine = llm.engine
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(batch):
            engine.add_request(f"decode-{i}", ids, params)
        engine.step()  # the prefill (and first token) of every sequence
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    timed(prompts(4, 100), 1)
    spinning = threading.Event()

    def spin() -> None:
        while True:
            spinning.wait()
            x = 0
            while x < 10_000:  # bytecode: the interval can interrupt it
                x += 1

    threading.Thread(target=spin, daemon=True).start()
    print(f"{'python thread':>13} {'interval':>9} {'prefill 20x100':>15} {'decode step x32':>16}")
    for busy in (False, True):
        if busy:
            spinning.set()
        for interval_ms in (float(x) for x in args.intervals.split(",")):
            sys.setswitchinterval(interval_ms / 1000)
            prefill, decode = [], []
            for _ in range(args.rounds):
                prefill.append(timed(prompts(20, 100), 1))
                decode.append(decode_step(prompts(32, 16)))
            print(
                f"{'spinning' if busy else 'none':>13} {interval_ms:>6.1f} ms "
                f"{statistics.median(prefill) * 1000:>12.1f} ms "
                f"{statistics.median(decode) * 1000:>13.2f} ms",
                flush=True,
            )
    spinning.clear()


if __name__ == "__main__":
    main()
