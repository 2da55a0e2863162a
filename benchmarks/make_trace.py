"""Write a synthetic request trace in Mooncake's JSONL format, seeded, for the simulator and the
live trace replay when no real trace is at hand.

    python -m benchmarks.make_trace --out results/synthetic_trace.jsonl
    python -m benchmarks.make_trace --num-requests 1000 --replicas 4 --seed 1 --out small.jsonl

(``python -m benchmarks.trace_kinds`` writes a multi-turn or a many-tenant mix the same way.)

One JSON object per line, as in the traces of the Mooncake FAST'25 release
(github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``): ``timestamp`` (ms since the start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the
prompt, the last block possibly partial; equal ids mean a reusable prefix). Those real traces are
the better input wherever they can be downloaded; this one is statistically shaped like their
``synthetic_trace.jsonl`` (3,993 requests), from which every constant below was measured:

- Arrivals: a Poisson process of ``rate`` requests per second (``--replicas K``: the load that
  trace puts on each of the 16 replicas of docs/routing.md, times K).
- Request kinds. A request brings new content with probability ``1 - 0.9 * i / n`` (request ``i``
  of ``n``: new content dries up over the trace as in the original, where the last tenth is almost
  all follow-ups); new content is, half and half, a short standalone prompt (one block, 13-509
  tokens, long answers: median 248 tokens) or a new document (518-191k tokens). Otherwise the
  request is a follow-up on an earlier document.
- Documents: 35% of them are asked about again; those run longer (median 19.9k tokens against
  15.7k). A follow-up picks one of those documents uniformly and one of its earlier requests:
  12% of the time it repeats that request exactly (same ``hash_ids`` and lengths), otherwise it
  asks a new question: it keeps all but the last 1-5 blocks of that request (one in 74% of cases)
  and replaces them with as many new ones, with a length within 8 tokens of it, as the
  original's questions on a shared document do. Answers about documents are short (median 30
  tokens, a long tail to ~900).
- Lengths: drawn from the original's quantiles (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100%),
  interpolated linearly in log space between them: long-tailed as measured, never beyond the
  measured extremes.
- ``hash_ids``: new blocks get the next unused integer, so ids appear in increasing order.

What comes out (4,000 requests, seeds 0-4) against the original: mean input 14.8-15.9k tokens
(15.3k), mean output 147-150 (149), 45-46% of requests share a prefix with an earlier one
(45%), infinite-cache block hit ratio 0.65-0.67 (0.64), 40-43k distinct blocks (43.9k), 365-380
documents asked about more than once, by at most 13-18 requests each (408, at most 24).

Not modelled: multi-turn conversations that append to a whole earlier request (the original has
none beyond exact repeats), any link between a document's length and how often it is reused
beyond the two length tables, bursty or diurnal arrivals.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_TOKENS = 512  # tokens per hash id, as in Mooncake's traces
# The Mooncake synthetic trace: 3,993 requests in 1,022 s, replayed on 16 replicas in docs/routing.md.
DEFAULT_RATE = 3.9
RATE_PER_REPLICA = DEFAULT_RATE / 16
DEFAULT_NUM_REQUESTS = 4000

# (quantile, tokens) tables measured on the Mooncake synthetic trace.
Quantiles = Sequence[tuple[float, int]]
_Q = (0.0, 0.01, 0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99, 1.0)
SHORT_INPUT: Quantiles = tuple(
    zip(_Q, (13, 13, 17, 19, 25, 40, 98, 275, 354, 467, 509), strict=True)
)
SHORT_OUTPUT: Quantiles = tuple(
    zip(_Q, (1, 4, 17, 31, 112, 248, 372, 558, 685, 782, 842), strict=True)
)
# Documents asked about more than once, and documents asked about once.
SHARED_DOC_INPUT: Quantiles = tuple(
    zip(_Q, (565, 633, 2681, 3728, 11211, 19864, 35702, 44240, 52978, 66469, 191374), strict=True)
)
SINGLE_DOC_INPUT: Quantiles = tuple(
    zip(_Q, (518, 543, 677, 858, 2935, 15658, 19551, 26323, 34799, 60506, 134773), strict=True)
)
DOC_OUTPUT: Quantiles = tuple(zip(_Q, (1, 2, 2, 3, 7, 30, 150, 312, 390, 672, 893), strict=True))

NEW_CONTENT_SLOPE = 0.9  # P(new content) = 1 - slope * i / n
SHORT_OF_NEW = 0.5  # of new content: a short standalone prompt rather than a document
REUSED_DOC = 0.35  # of new documents: asked about again later
REPEAT = 0.12  # of follow-ups: the very same request again
# How many trailing blocks a new question replaces, and how often.
REPLACED_BLOCKS = (1, 2, 3, 4, 5)
REPLACED_WEIGHTS = (0.74, 0.17, 0.07, 0.015, 0.005)
QUESTION_LENGTH_JITTER = 8  # tokens


def default_out() -> Path:
    """``traces/synthetic_trace.jsonl`` in the cache directory (``$PREFIXSERVE_CACHE_DIR``, else
    ``~/.cache/prefixserve``, as for converted models)."""
    root = Path(os.environ.get("PREFIXSERVE_CACHE_DIR", "~/.cache/prefixserve")).expanduser()
    return root / "traces" / "synthetic_trace.jsonl"


def _draw(rng: np.random.Generator, table: Quantiles) -> int:
    """One length from a quantile table, interpolated linearly in log space."""
    q = [p for p, _ in table]
    logs = np.log([v for _, v in table])
    return round(math.exp(float(np.interp(rng.random(), q, logs))))


def generate(
    num_requests: int = DEFAULT_NUM_REQUESTS, rate: float = DEFAULT_RATE, seed: int = 0
) -> list[dict[str, Any]]:
    """``num_requests`` trace records (see the module docstring for the model), in arrival order.
    A pure function of its arguments."""
    if num_requests < 1:
        raise ValueError(f"num_requests: must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    gaps_ms = rng.exponential(1000.0 / rate, size=num_requests)
    gaps_ms[0] = 0.0
    timestamps = np.cumsum(gaps_ms).round().astype(np.int64)

    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    # Requests on each document that may be asked about again.
    reused: list[list[dict[str, Any]]] = []
    records: list[dict[str, Any]] = []
    for i in range(num_requests):
        new_content = not reused or rng.random() >= NEW_CONTENT_SLOPE * i / num_requests
        if new_content and rng.random() < SHORT_OF_NEW:
            shape = {
                "input_length": min(_draw(rng, SHORT_INPUT), BLOCK_TOKENS),
                "output_length": _draw(rng, SHORT_OUTPUT),
                "hash_ids": fresh(1),
            }
        elif new_content:
            again = rng.random() < REUSED_DOC
            length = _draw(rng, SHARED_DOC_INPUT if again else SINGLE_DOC_INPUT)
            shape = {
                "input_length": length,
                "output_length": _draw(rng, DOC_OUTPUT),
                "hash_ids": fresh(math.ceil(length / BLOCK_TOKENS)),
            }
            if again:
                reused.append([shape])
        else:
            doc = reused[int(rng.integers(len(reused)))]
            source = doc[int(rng.integers(len(doc)))]
            if rng.random() < REPEAT:
                shape = {**source, "hash_ids": list(source["hash_ids"])}
            else:
                ids = source["hash_ids"]
                n = len(ids)
                replaced = min(int(rng.choice(REPLACED_BLOCKS, p=REPLACED_WEIGHTS)), n - 1)
                jitter = int(rng.integers(-QUESTION_LENGTH_JITTER, QUESTION_LENGTH_JITTER + 1))
                # Same number of blocks: the length stays in ((n - 1) * 512, n * 512].
                length = min(
                    max(source["input_length"] + jitter, (n - 1) * BLOCK_TOKENS + 1),
                    n * BLOCK_TOKENS,
                )
                shape = {
                    "input_length": length,
                    "output_length": _draw(rng, DOC_OUTPUT),
                    "hash_ids": ids[: n - replaced] + fresh(replaced),
                }
            doc.append(shape)
        records.append({"timestamp": int(timestamps[i]), **shape})
    return records


def trace_stats(records: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Summary of a Mooncake-format trace: request count, span and rate, mean lengths, the share
    of requests whose first block an earlier request had, the block hit ratio of an infinite
    cache, and the number of distinct blocks."""
    records = list(records)
    seen: set[int] = set()
    hits = blocks = sharing = 0
    for r in records:
        ids = r["hash_ids"]
        sharing += bool(ids) and ids[0] in seen
        for h in ids:
            blocks += 1
            hits += h in seen
            seen.add(h)
    n = len(records)
    span_s = (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000.0 if records else 0.0
    return {
        "requests": n,
        "span_s": span_s,
        "rate": (n - 1) / span_s if span_s > 0 else 0.0,
        "mean_input": sum(r["input_length"] for r in records) / max(n, 1),
        "mean_output": sum(r["output_length"] for r in records) / max(n, 1),
        "sharing_fraction": sharing / max(n, 1),
        "infinite_cache_hit_ratio": hits / max(blocks, 1),
        "distinct_blocks": len(seen),
    }


def write_trace(records: Iterable[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.make_trace",
        description="Write a seeded synthetic trace in Mooncake's JSONL format (see the module "
        "docstring for what it models).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=None,
                   help=f"output file; default {default_out()}")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None,
                      help=f"Poisson arrivals per second; default {DEFAULT_RATE}, the Mooncake "
                      "synthetic trace's")  # fmt: skip
    load.add_argument("--replicas", type=float, default=None,
                      help=f"arrivals for this many replicas: {RATE_PER_REPLICA:.3f} req/s each, "
                      "the Mooncake trace's load on each of 16 replicas")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    return p


def rate_from_args(args: argparse.Namespace) -> float:
    """The arrival rate ``--rate`` / ``--replicas`` ask for; exits on a bad value."""
    if args.replicas is not None:
        if not args.replicas > 0:
            raise SystemExit("--replicas: must be > 0")
        rate = args.replicas * RATE_PER_REPLICA
    else:
        rate = DEFAULT_RATE if args.rate is None else args.rate
    if args.num_requests < 1 or not rate > 0:
        raise SystemExit("--num-requests and the rate must be positive")
    return rate


def write_and_describe(records: list[dict[str, Any]], out: Path) -> None:
    """Write the trace, a summary line on stderr and its path on stdout."""
    write_trace(records, out)
    s = trace_stats(records)
    print(
        f"{s['requests']} requests over {s['span_s']:.0f} s ({s['rate']:.2f} req/s), mean input "
        f"{s['mean_input']:.0f} / output {s['mean_output']:.0f} tokens, "
        f"{s['sharing_fraction']:.0%} share a prefix, infinite-cache hit ratio "
        f"{s['infinite_cache_hit_ratio']:.2f}, {s['distinct_blocks']} distinct blocks",
        file=sys.stderr,
    )
    print(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rate = rate_from_args(args)
    out = args.out if args.out is not None else default_out()
    write_and_describe(generate(args.num_requests, rate, args.seed), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
