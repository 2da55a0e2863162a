"""Builders shared by the router tests."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from engine.block_hash import compute_block_hashes, hash_root

BLOCK = 16


def report(
    replica_id: str,
    hashes: Iterable[int] = (),
    *,
    at: float,
    running: int = 0,
    waiting: int = 0,
    started_at: float = 1.0,
    free: int = 1000,
    total: int = 1000,
    pending_prefill_tokens: int = 0,
) -> dict[str, Any]:
    """A routing-stats dict as an engine replica's ``record_routing_stats()`` returns it."""
    return {
        "replica_id": replica_id,
        "started_at": started_at,
        "block_size": BLOCK,
        "num_running": running,
        "num_waiting": waiting,
        "kv_free_blocks": free,
        "kv_total_blocks": total,
        "cached_block_hashes": list(hashes),
        "reported_at": at,
        "num_pending_prefill_tokens": pending_prefill_tokens,
    }


def prompt_hashes(tokens: list[int]) -> list[int]:
    return compute_block_hashes(tokens, BLOCK, hash_root("test-model"))


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]
