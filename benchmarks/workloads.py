"""Benchmark workloads: lists of token-id prompts with output lengths and optional arrival times.

Every generator is deterministic for its arguments (seeded), so the live benchmark client and an
offline simulator that import these functions see exactly the same requests.

Token ids are drawn from ``[SPECIAL_ID_MARGIN, vocab_size - SPECIAL_ID_MARGIN)``: tokenizers put
their special tokens (BOS/EOS, chat markers) at the ends of the vocabulary, and a random prompt
must not contain them.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

DEFAULT_VOCAB_SIZE = 49152  # SmolLM2
SPECIAL_ID_MARGIN = 100
TRACE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake traces

ArrivalOrder = Literal["interleaved", "grouped", "random"]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    Invariants: ``prompt_token_ids`` is non-empty and every id lies in the safe range of the
    vocabulary it was drawn for; ``output_len >= 1``; ``0 <= shared_prefix_len <=
    len(prompt_token_ids)``. ``arrival_time`` (seconds since the start of the run) is set only by
    workloads that carry their own timing (traces); ``hash_ids`` only by traces, one per
    ``block_tokens`` tokens of the prompt (the last block may be partial).
    """

    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float | None = None
    # Leading tokens that form a shared system prompt; a chat request sends them as a system message.
    shared_prefix_len: int = 0
    group: int | None = None
    hash_ids: tuple[int, ...] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def safe_id_range(vocab_size: int) -> tuple[int, int]:
    """Half-open range ``[low, high)`` of token ids that are safe to put in a random prompt."""
    low, high = SPECIAL_ID_MARGIN, vocab_size - SPECIAL_ID_MARGIN
    if high <= low:
        raise ValueError(f"vocab_size: must exceed {2 * SPECIAL_ID_MARGIN}, got {vocab_size}")
    return low, high


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    low, high = safe_id_range(vocab_size)
    return rng.integers(low, high, size=n).tolist()


def random_requests(
    num_prompts: int,
    *,
    input_len_min: int = 64,
    input_len_max: int = 128,
    output_len: int = 128,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    distinct_prefix_len: int = 16,
) -> list[WorkloadRequest]:
    """``num_prompts`` prompts of uniform random length in ``[input_len_min, input_len_max]``.

    No two prompts share their first ``min(distinct_prefix_len, len)`` tokens (one KV block at the
    default block size), so a prefix cache can never hit across them.
    """
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError(
            f"need 1 <= input_len_min <= input_len_max, got {input_len_min}, {input_len_max}"
        )
    _check_positive(output_len=output_len, distinct_prefix_len=distinct_prefix_len)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(input_len_min, input_len_max + 1, size=num_prompts).tolist()
    seen: set[tuple[int, ...]] = set()
    out: list[WorkloadRequest] = []
    for n in lengths:
        ids = _random_ids(rng, n, vocab_size)
        while tuple(ids[:distinct_prefix_len]) in seen:
            ids[:distinct_prefix_len] = _random_ids(rng, min(n, distinct_prefix_len), vocab_size)
        seen.add(tuple(ids[:distinct_prefix_len]))
        out.append(WorkloadRequest(prompt_token_ids=ids, output_len=output_len))
    return out


def shared_prefix_requests(
    *,
    num_groups: int = 8,
    prompts_per_group: int = 8,
    prefix_len: int = 512,
    question_len: int = 64,
    output_len: int = 128,
    arrival_order: ArrivalOrder = "interleaved",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Groups of prompts that share a system prompt of ``prefix_len`` tokens, each followed by a
    distinct question of ``question_len`` tokens.

    Group prefixes differ in their first token and questions within a group differ in their first
    token, so the shared part of two prompts is exactly the group prefix (or nothing).
    ``arrival_order``: ``grouped`` sends each group's prompts back to back, ``interleaved`` sends
    one prompt of every group in turn (round robin), ``random`` shuffles them (seeded).
    """
    _check_positive(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        question_len=question_len,
        output_len=output_len,
    )
    if prefix_len < 0:
        raise ValueError(f"prefix_len: must be >= 0, got {prefix_len}")
    low, high = safe_id_range(vocab_size)
    if max(num_groups, prompts_per_group) > high - low:
        raise ValueError("too many groups or prompts per group for distinct first tokens")
    rng = np.random.default_rng(seed)
    prefix_firsts = _distinct_ids(rng, num_groups, vocab_size)
    groups: list[list[WorkloadRequest]] = []
    for g in range(num_groups):
        prefix = [prefix_firsts[g], *_random_ids(rng, prefix_len - 1, vocab_size)][:prefix_len]
        question_firsts = _distinct_ids(rng, prompts_per_group, vocab_size)
        groups.append(
            [
                WorkloadRequest(
                    prompt_token_ids=prefix
                    + [question_firsts[q], *_random_ids(rng, question_len - 1, vocab_size)],
                    output_len=output_len,
                    shared_prefix_len=prefix_len,
                    group=g,
                )
                for q in range(prompts_per_group)
            ]
        )
    if arrival_order == "grouped":
        return [r for group in groups for r in group]
    if arrival_order == "interleaved":
        return [group[q] for q in range(prompts_per_group) for group in groups]
    if arrival_order == "random":
        flat = [r for group in groups for r in group]
        return [flat[i] for i in rng.permutation(len(flat))]
    raise ValueError(f"arrival_order: expected interleaved|grouped|random, got {arrival_order!r}")


def _distinct_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    low, high = safe_id_range(vocab_size)
    return (low + rng.choice(high - low, size=n, replace=False)).tolist()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")


# --- Mooncake traces ---------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_id_blocks(
    hash_ids: Sequence[int],
    block_tokens: int,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> np.ndarray:
    """Token ids for many trace blocks at once: row ``i`` is :func:`hash_id_block` of
    ``hash_ids[i]`` (an ``int64`` array of shape ``(len(hash_ids), block_tokens)``)."""
    low, high = safe_id_range(vocab_size)
    mask = 0xFFFFFFFFFFFFFFFF
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & mask], dtype=np.uint64) * _GOLDEN)
        ids = np.array([h & mask for h in hash_ids], dtype=np.uint64)
        keys = _splitmix64(key ^ ids)
        positions = np.arange(1, block_tokens + 1, dtype=np.uint64)
        mixed = _splitmix64(keys[:, None] + positions[None, :] * _GOLDEN)
    return low + (mixed % np.uint64(high - low)).astype(np.int64)


def hash_id_block(
    hash_id: int, block_tokens: int, *, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0
) -> list[int]:
    """The ``block_tokens`` token ids that stand for trace block ``hash_id``.

    A pure function of its arguments (SplitMix64 over ``(seed, hash_id, position)``, independent
    of any RNG library's stream), so equal hash ids give equal tokens in every request, process
    and run. The first ``k`` tokens of a block do not depend on ``block_tokens``.
    """
    return hash_id_blocks([hash_id], block_tokens, vocab_size=vocab_size, seed=seed)[0].tolist()


def trace_slice(path: str | Path, *, offset: int = 0, limit: int | None = None) -> list[dict]:
    """Records ``offset`` to ``offset + limit`` of a trace. With ``offset > 0`` their timestamps
    are shifted so that the first kept record arrives at 0 (a slice from the middle of a trace
    starts at once)."""
    if offset < 0:
        raise ValueError(f"offset: must be >= 0, got {offset}")
    stop = None if limit is None else offset + limit
    records = list(itertools.islice(read_trace(path), offset, stop))
    if offset and records:
        start = records[0]["timestamp"]
        records = [{**r, "timestamp": r["timestamp"] - start} for r in records]
    return records


def read_trace(path: str | Path) -> Iterator[dict]:
    """The raw records of a Mooncake-format JSONL trace, in file order (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


@dataclass(frozen=True)
class ScaledTraceRecord:
    """The shape of one trace record after scaling (see :func:`trace_requests` for the rules):
    ``prompt_len`` tokens made of the blocks of ``hash_ids`` (``block_tokens`` each, the last one
    possibly partial), ``output_len`` tokens to generate, ``arrival_time`` in seconds."""

    prompt_len: int
    output_len: int
    arrival_time: float
    hash_ids: tuple[int, ...]


def scale_trace_shape(
    record: dict,
    *,
    block_tokens: int = 16,
    output_scale: float = 1.0,
    max_output_len: int | None = 128,
    time_scale: float = 1.0,
    max_input_len: int | None = None,
) -> ScaledTraceRecord:
    """Lengths, arrival and blocks of one scaled record, without generating token ids. The live
    replay (:func:`scale_trace_record`) and the simulator (``benchmarks.sim``) both use it, so they
    scale a trace identically."""
    hash_ids = [int(h) for h in record["hash_ids"]]
    input_length = int(record["input_length"])
    if not hash_ids or input_length < 1:
        raise ValueError(f"trace record without input: {record!r}")
    # input_length lies in ((n-1)*512, n*512] for n hash ids, so the ceiling lies in
    # ((n-1)*B, n*B]: every hash id keeps at least one token and only the last block is partial.
    scaled_len = min(
        len(hash_ids) * block_tokens, math.ceil(input_length * block_tokens / TRACE_BLOCK_SIZE)
    )
    if max_input_len is not None:
        scaled_len = min(scaled_len, max_input_len)
    used = hash_ids[: math.ceil(scaled_len / block_tokens)]
    output_len = max(1, round(int(record["output_length"]) * output_scale))
    if max_output_len is not None:
        output_len = min(output_len, max_output_len)
    return ScaledTraceRecord(
        prompt_len=scaled_len,
        output_len=output_len,
        arrival_time=float(record["timestamp"]) / 1000.0 * time_scale,
        hash_ids=tuple(used),
    )


def scale_trace_record(
    record: dict,
    *,
    block_tokens: int = 16,
    output_scale: float = 1.0,
    max_output_len: int | None = 128,
    time_scale: float = 1.0,
    max_input_len: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    block_cache: dict[int, list[int]] | None = None,
) -> WorkloadRequest:
    """Scale one trace record down; see :func:`trace_requests` for the rules.

    ``block_cache`` (hash id -> tokens) memoises :func:`hash_id_block` across records; it must
    only be shared between calls with the same ``block_tokens``, ``vocab_size`` and ``seed``.
    """
    shape = scale_trace_shape(
        record,
        block_tokens=block_tokens,
        output_scale=output_scale,
        max_output_len=max_output_len,
        time_scale=time_scale,
        max_input_len=max_input_len,
    )
    ids: list[int] = []
    for h in shape.hash_ids:
        block = block_cache.get(h) if block_cache is not None else None
        if block is None:
            block = hash_id_block(h, block_tokens, vocab_size=vocab_size, seed=seed)
            if block_cache is not None:
                block_cache[h] = block
        ids.extend(block)
    return WorkloadRequest(
        prompt_token_ids=ids[: shape.prompt_len],
        output_len=shape.output_len,
        arrival_time=shape.arrival_time,
        hash_ids=shape.hash_ids,
    )


def trace_requests(
    path: str | Path,
    *,
    block_tokens: int = 16,
    output_scale: float = 1.0,
    max_output_len: int | None = 128,
    time_scale: float = 1.0,
    limit: int | None = None,
    max_input_len: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    offset: int = 0,
) -> list[WorkloadRequest]:
    """A Mooncake-format trace scaled down for replay against a small model.

    - Each hash id (a 512-token block in the trace) becomes ``block_tokens`` deterministic token
      ids (:func:`hash_id_block`): requests that share hash ids share exactly those tokens.
    - Input length ``L`` becomes ``ceil(L * block_tokens / 512)``, which keeps every hash id and
      truncates only the last block; ``max_input_len`` then cuts long prompts (whole leading
      blocks survive, so sharing is kept); ``hash_ids`` lists the blocks actually used.
    - Output length becomes ``max(1, round(output_length * output_scale))``, capped at
      ``max_output_len``.
    - Arrival time (seconds) is ``timestamp_ms / 1000 * time_scale``: the timestamps are
      *multiplied*, so ``time_scale=0.1`` replays ten times faster and ``2`` half as fast.
    - ``offset`` skips the first ``offset`` records (arrival times are then measured from the
      first kept record's timestamp), and ``limit`` takes the next ``limit`` records.
    """
    _check_positive(block_tokens=block_tokens)
    if time_scale < 0 or output_scale < 0:
        raise ValueError("time_scale and output_scale must be >= 0")
    records = trace_slice(path, offset=offset, limit=limit)
    # Generating every distinct block in one vectorised call is ~50x faster than one by one.
    distinct = sorted({int(h) for record in records for h in record["hash_ids"]})
    blocks = hash_id_blocks(distinct, block_tokens, vocab_size=vocab_size, seed=seed).tolist()
    cache = dict(zip(distinct, blocks, strict=True))
    out: list[WorkloadRequest] = []
    for record in records:
        out.append(
            scale_trace_record(
                record,
                block_tokens=block_tokens,
                output_scale=output_scale,
                max_output_len=max_output_len,
                time_scale=time_scale,
                max_input_len=max_input_len,
                vocab_size=vocab_size,
                seed=seed,
                block_cache=cache,
            )
        )
    return out
