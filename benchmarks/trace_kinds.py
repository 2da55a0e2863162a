"""Two more request mixes in Mooncake's trace format, for comparing routers on sharing patterns the
synthetic trace (``benchmarks.make_trace``) lacks. Both are seeded, pure functions of their
arguments, and write records the simulator and the live replay read as they read
``make_trace``'s (one id per
512-token block, the last block possibly partial, new ids in increasing order).

``conversation_trace``: multi-turn chats, each turn extending the previous one. Conversations
start as a Poisson process; each has 1 + Geometric turns (mean ``mean_turns``, at most
``max_turns``). Turn 1 is a system prompt plus a first message (256 to 4,096 tokens, log-uniform);
turn k's prompt is turn k-1's prompt, its answer and a new user message (lengths from the
Mooncake short-prompt tables of ``make_trace``). It keeps every *full* block of the previous
prompt (the previous partial block is rewritten, as an engine's block hashes see it), so a turn
shares all but at most one block of its predecessor's prompt. A user replies ``think_s`` (plus an
exponential with the same mean) after the previous turn arrived; a conversation ends after its
turns or once its prompt exceeds ``max_context`` tokens.

``tenant_trace``: ``num_tenants`` tenants, each with its own long system prompt (whole blocks,
1,024 to 8,192 tokens, log-uniform), chosen per request with Zipf popularity (weight
``1 / rank ** zipf_s``); each request is the tenant's system prompt plus a short question
(Mooncake short-prompt lengths, 13 to 509 tokens), answered briefly (the document-answer table:
median 30 tokens). Poisson arrivals.

The shapes are modelling choices (no public trace of either kind was at hand), not measurements.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import make_trace
from benchmarks.make_trace import (
    BLOCK_TOKENS,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_RATE,
    DOC_OUTPUT,
    SHORT_INPUT,
    SHORT_OUTPUT,
    _draw,
)

KINDS = ("conversation", "tenants")


def _log_uniform(rng: np.random.Generator, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _finish(records: list[dict[str, Any]], num_requests: int) -> list[dict[str, Any]]:
    """The first ``num_requests`` records by time (stable), timestamps from 0, ids renumbered in
    order of first appearance."""
    records.sort(key=lambda r: r["timestamp"])
    records = records[:num_requests]
    start = records[0]["timestamp"] if records else 0
    renumber: dict[int, int] = {}
    out = []
    for r in records:
        ids = [renumber.setdefault(h, len(renumber)) for h in r["hash_ids"]]
        out.append(
            {
                "timestamp": int(r["timestamp"] - start),
                "input_length": r["input_length"],
                "output_length": r["output_length"],
                "hash_ids": ids,
            }
        )
    return out


def _fresh_ids() -> Callable[[int], list[int]]:
    counter = iter(range(1 << 62))
    return lambda n: [next(counter) for _ in range(n)]


def conversation_trace(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    rate: float = DEFAULT_RATE,
    seed: int = 0,
    *,
    mean_turns: float = 5.0,
    max_turns: int = 20,
    think_s: float = 15.0,
    max_context: int = 32_768,
) -> list[dict[str, Any]]:
    """``num_requests`` turns of multi-turn conversations arriving at about ``rate`` requests per
    second overall (see the module docstring)."""
    _check(num_requests, rate)
    rng = np.random.default_rng(seed)
    fresh = _fresh_ids()
    records: list[dict[str, Any]] = []
    t_ms = 0.0
    # Generate conversations until enough turns start before the last one needed; a
    # conversation's turns spread over time, so draw extra and keep the earliest.
    while len(records) < 2 * num_requests:
        t_ms += rng.exponential(1000.0 * mean_turns / rate)
        turns = min(int(rng.geometric(1.0 / mean_turns)), max_turns)
        length = _log_uniform(rng, 256, 4096)
        ids = fresh(math.ceil(length / BLOCK_TOKENS))
        at = t_ms
        for _ in range(turns):
            output = _draw(rng, SHORT_OUTPUT)
            records.append(
                {"timestamp": at, "input_length": length, "output_length": output, "hash_ids": ids}
            )
            new_length = length + output + _draw(rng, SHORT_INPUT)
            if new_length > max_context:
                break
            kept = ids[: length // BLOCK_TOKENS]
            ids = kept + fresh(math.ceil(new_length / BLOCK_TOKENS) - len(kept))
            length = new_length
            at += 1000.0 * (think_s + rng.exponential(think_s))
    return _finish(records, num_requests)


def tenant_trace(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    rate: float = DEFAULT_RATE,
    seed: int = 0,
    *,
    num_tenants: int = 150,
    zipf_s: float = 1.0,
) -> list[dict[str, Any]]:
    """``num_requests`` short questions to ``num_tenants`` tenants' long system prompts, Zipf
    popularity, Poisson arrivals at ``rate`` per second (see the module docstring)."""
    _check(num_requests, rate)
    if num_tenants < 1 or zipf_s < 0:
        raise ValueError("num_tenants must be >= 1 and zipf_s >= 0")
    rng = np.random.default_rng(seed)
    fresh = _fresh_ids()
    system = [fresh(_log_uniform(rng, 1024, 8192) // BLOCK_TOKENS) for _ in range(num_tenants)]
    weights = 1.0 / np.arange(1, num_tenants + 1) ** zipf_s
    popularity = weights / weights.sum()
    gaps = rng.exponential(1000.0 / rate, size=num_requests)
    gaps[0] = 0.0
    records = []
    for t_ms in np.cumsum(gaps):
        prompt = system[int(rng.choice(num_tenants, p=popularity))]
        question = _draw(rng, SHORT_INPUT)
        records.append(
            {
                "timestamp": float(t_ms),
                "input_length": len(prompt) * BLOCK_TOKENS + question,
                "output_length": _draw(rng, DOC_OUTPUT),
                "hash_ids": prompt + fresh(math.ceil(question / BLOCK_TOKENS)),
            }
        )
    return _finish(records, num_requests)


def _check(num_requests: int, rate: float) -> None:
    if num_requests < 1:
        raise ValueError(f"num_requests: must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0, got {rate}")


def build_parser() -> argparse.ArgumentParser:
    p = make_trace.build_parser()
    p.prog = "python -m benchmarks.trace_kinds"
    p.description = "Write a seeded multi-turn or many-tenant trace in Mooncake's JSONL format."
    p.add_argument("--kind", choices=KINDS, default="conversation")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rate = make_trace.rate_from_args(args)
    make = conversation_trace if args.kind == "conversation" else tenant_trace
    out = args.out
    if out is None:
        out = make_trace.default_out().with_name(f"{args.kind}_trace.jsonl")
    make_trace.write_and_describe(make(args.num_requests, rate, args.seed), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
