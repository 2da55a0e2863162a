"""Time one prefill forward with and without the last-layer pruning (``forward(keep=...)``).

    python -m benchmarks.prefill_step --prompts 20 --tokens 100 --rounds 6

Admits ``--prompts`` fresh prompts of ``--tokens`` random tokens, builds their one prefill batch
(they must fit ``max_num_batched_tokens``), then times the model's forward over it, alternating
between computing the last layer for every row and for the sampled rows only (the engine's
path). The forward writes the same KV each time, so the runs are interchangeable; the LM head and
sampling are not included.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.model_runner import ScheduledSeq


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = max(2048, args.prompts * args.tokens)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=budget,
    )
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    requests = [
        engine.add_request(str(i), [rng.randrange(100, 49152) for _ in range(args.tokens)], params)
        for i in range(args.prompts)
    ]
    for r in requests:
        if not engine.kv.allocate_slots(r, r.num_tokens):
            raise SystemExit("the prompts do not fit the KV cache")
    runner = engine.runner
    batch = runner.prepare(
        [ScheduledSeq(r, r.num_tokens, engine.kv.block_ids(r.request_id)) for r in requests]
    )

    def forward(keep: torch.Tensor | None) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta, keep)
        return time.perf_counter() - t0

    for _ in range(2):
        forward(None)
    times: dict[str, list[float]] = {"every row": [], "sampled rows": []}
    for _ in range(args.rounds):
        times["every row"].append(forward(None))
        times["sampled rows"].append(forward(batch.logits_indices))
    tokens = args.prompts * args.tokens
    print(
        f"{args.prompts} prompts x {args.tokens} tokens ({tokens} tokens), {args.dtype}, "
        f"threads={torch.get_num_threads()}, {args.rounds} rounds alternating"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  last layer for {name:12s}: median {med * 1e3:7.1f} ms, best {min(ts) * 1e3:7.1f} "
            f"ms ({tokens / med:.0f} tok/s)"
        )


if __name__ == "__main__":
    main()
