"""Time one prefill forward with and without the last-layer pruning (``forward(keep=...)``),
with and without whole prompts batched into one SDPA call per layer (``--compare sdpa-batch``,
the CPU attention backend's ``batch_whole_prompts``), or with long chunks on SDPA against every
chunk in the native kernel (``--compare native``, the backend's ``native_max_pairs``), or with
prefill-sized linears on oneDNN against the packed tiles' kernels (``--compare linear``:
``linear.PACKED_MAX_ROWS`` and ``GATED_MAX_ROWS`` at the decode bound, then as shipped).

    python -m benchmarks.prefill_step --prompts 20 --tokens 100 --rounds 6
    python -m benchmarks.prefill_step --compare sdpa-batch --prompts 3 --tokens 544
    python -m benchmarks.prefill_step --compare native --prompts 20 --tokens 100
    python -m benchmarks.prefill_step --compare linear --prompts 12 --tokens 100

Admits ``--prompts`` fresh prompts of ``--tokens`` random tokens, builds their one prefill batch
(they must fit ``max_num_batched_tokens``), then times the model's forward over it, alternating
between the two variants (the engine's path is the second of each pair). The forward writes the
same KV each time, so the runs are interchangeable; the LM head and sampling are not included.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.attention.cpu_backend import NATIVE_MAX_PAIRS
from engine.kernels import native
from engine.model import linear
from engine.model_runner import ScheduledSeq


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--compare", choices=["prune", "sdpa-batch", "native", "linear"], default="prune"
    )
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
    seqs = [ScheduledSeq(r, r.num_tokens, engine.kv.block_ids(r.request_id)) for r in requests]
    batch = runner.prepare(seqs)
    variants = {"last layer for every row": (batch, None)}
    # Per variant, the linear row bounds it runs under (variants not here: as shipped).
    bounds: dict[str, tuple[dict[str, int | None], dict[str, int | None]]] = {}
    if args.compare == "prune":
        variants["last layer for sampled rows"] = (batch, batch.logits_indices)
    elif args.compare == "linear":
        kind = native.decode_linear_kind()
        if kind is None:
            raise SystemExit("--compare linear needs a decode linear kernel (AMX or AVX512-BF16)")
        decode = linear.DECODE_MAX_ROWS[kind]
        variants = {
            "oneDNN past the decode bound": (batch, batch.logits_indices),
            "packed tiles as shipped": (batch, batch.logits_indices),
        }
        bounds["oneDNN past the decode bound"] = (
            {**linear.PACKED_MAX_ROWS, kind: decode},
            {**linear.GATED_MAX_ROWS, kind: decode},
        )
    else:
        # Two plans of the same step, each prepared with one setting of the CPU backend.
        attr, settings = {
            "native": (
                "native_max_pairs",
                {
                    "long chunks on SDPA": NATIVE_MAX_PAIRS,
                    "every chunk native": None,
                },
            ),
            "sdpa-batch": (
                "batch_whole_prompts",
                {
                    "an SDPA call per prompt": False,
                    "prompts batched in SDPA": True,
                },
            ),
        }[args.compare]
        backend = runner.backend
        if not hasattr(backend, attr):
            raise SystemExit(f"--compare {args.compare} needs the cpu attention backend")
        chosen = getattr(backend, attr)
        variants = {}
        for name, value in settings.items():
            setattr(backend, attr, value)
            prepared = runner.prepare(seqs)
            variants[name] = (prepared, prepared.logits_indices)
        setattr(backend, attr, chosen)

    shipped = (dict(linear.PACKED_MAX_ROWS), dict(linear.GATED_MAX_ROWS))

    def forward(variant: str) -> float:
        b, keep = variants[variant]
        packed_rows, gated_rows = bounds.get(variant) or shipped
        linear.PACKED_MAX_ROWS.update(packed_rows)
        linear.GATED_MAX_ROWS.update(gated_rows)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                runner.model(b.input_ids, b.positions, runner.kv_caches, b.meta, keep)
            return time.perf_counter() - t0
        finally:
            linear.PACKED_MAX_ROWS.update(shipped[0])
            linear.GATED_MAX_ROWS.update(shipped[1])

    for name in variants:
        forward(name)
        forward(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            times[name].append(forward(name))
    tokens = args.prompts * args.tokens
    print(
        f"{args.prompts} prompts x {args.tokens} tokens ({tokens} tokens), {args.dtype}, "
        f"threads={torch.get_num_threads()}, {args.rounds} rounds alternating"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:28s}: median {med * 1e3:7.1f} ms, best {min(ts) * 1e3:7.1f} "
            f"ms ({tokens / med:.0f} tok/s)"
        )


if __name__ == "__main__":
    main()
