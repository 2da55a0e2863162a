"""A Mooncake-format trace as the simulator sees it: arrival, lengths and chained block hashes.

Scaling is :func:`benchmarks.workloads.scale_trace_shape`, the very function the live replay uses,
so a simulated request has the same prompt length, output length, arrival time and blocks as the
request ``benchmarks.serve --workload trace`` sends with the same flags.

Block hashes. In the live replay, each trace hash id becomes ``block_tokens`` deterministic token
ids and the engine hashes full blocks with ``engine.block_hash`` (each hash chained on its
parent). Generating those tokens for a whole trace is wasteful (at ``block_tokens=512`` it is 22
million ids), so the simulator chains the engine's hash over the ids themselves::

    H(block i) = hash_block_tokens(H(block i-1), [id_i low 32 bits, id_i high 32 bits], ROOT)

Two prompts then share their first ``k`` block hashes exactly when they share their first ``k``
hash ids, which is exactly when the live prompts share their first ``k * block_tokens`` tokens:
the same notion of "same prefix" (``tests/benchmarks/test_simulate.py`` checks it against the live
hashes). Only *full* blocks are hashed, as in the engine: a scaled prompt whose last block is
partial has ``prompt_len // block_tokens`` hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import scale_trace_shape, trace_slice
from engine.block_hash import hash_block_tokens, hash_root

ROOT = hash_root("mooncake-trace")
_U32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SimRequestSpec:
    """One request to replay. ``block_hashes`` are the chained hashes of the prompt's full blocks
    (``prompt_len // block_tokens`` of them); ``arrival`` is in seconds."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...]


def chain_hash_ids(
    hash_ids: Sequence[int], memo: dict[tuple[int | None, int], int] | None = None
) -> list[int]:
    """Chained block hashes of a sequence of trace hash ids (see the module docstring).

    ``memo`` maps (parent hash, id) to the block's hash; sharing it across requests makes a
    repeated prefix cost one dict lookup per block."""
    out: list[int] = []
    parent: int | None = None
    for h in hash_ids:
        key = (parent, h)
        value = memo.get(key) if memo is not None else None
        if value is None:
            value = hash_block_tokens(parent, [h & _U32, (h >> 32) & _U32], ROOT)
            if memo is not None:
                memo[key] = value
        out.append(value)
        parent = value
    return out


def load_trace(
    path: str | Path,
    *,
    block_tokens: int = 16,
    output_scale: float = 1.0,
    max_output_len: int | None = 128,
    time_scale: float = 1.0,
    max_input_len: int | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[SimRequestSpec]:
    """Records ``offset`` to ``offset + limit`` of the trace, scaled like
    ``benchmarks.workloads.trace_requests`` (same slicing), in arrival order (stable for equal
    times)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens: must be >= 1, got {block_tokens}")
    memo: dict[tuple[int | None, int], int] = {}
    specs: list[SimRequestSpec] = []
    for index, record in enumerate(trace_slice(path, offset=offset, limit=limit)):
        shape = scale_trace_shape(
            record,
            block_tokens=block_tokens,
            output_scale=output_scale,
            max_output_len=max_output_len,
            time_scale=time_scale,
            max_input_len=max_input_len,
        )
        full = shape.prompt_len // block_tokens
        specs.append(
            SimRequestSpec(
                index=index,
                arrival=shape.arrival_time,
                prompt_len=shape.prompt_len,
                output_len=shape.output_len,
                block_hashes=tuple(chain_hash_ids(shape.hash_ids[:full], memo)),
            )
        )
    specs.sort(key=lambda s: s.arrival)
    return specs


def distinct_blocks(specs: Sequence[SimRequestSpec]) -> int:
    """Number of distinct full prompt blocks in the trace (the working set of an infinite cache)."""
    return len({h for s in specs for h in s.block_hashes})
