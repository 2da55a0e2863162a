"""The routing-stats report an engine replica publishes (``record_routing_stats()``), validated.

Contract (a plain dict, so that it crosses process and pickling boundaries unchanged)::

    {"replica_id": str, "started_at": float, "block_size": int,
     "num_running": int, "num_waiting": int, "kv_free_blocks": int, "kv_total_blocks": int,
     "cached_block_hashes": list[int],   # every hash in the replica's prefix cache (full snapshot)
     "reported_at": float,               # time.time() when the snapshot was taken
     "num_pending_prefill_tokens": int,  # optional (0 if absent): prompt tokens queued for prefill
     "transfer_cost_ratio": float,       # optional: seconds to import a block published on the
                                         # replica's own node over seconds to prefill one, as the
                                         # replica measured them
     "cross_node_transfer_cost_ratio": float,  # optional: the same for blocks published on
                                         # another node (their bytes cross object stores)
     "node_id": str,                     # optional: the Ray node the replica runs on
     "decode_step_s": float,             # optional: recent seconds between consecutive steps
                                         # that carry decode rows (None while nothing decodes)
     "recent_sessions": list[[str, int]]}  # optional: sessions served lately and each one's
                                         # latest prompt length in blocks, oldest first
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_INT_FIELDS = ("block_size", "num_running", "num_waiting", "kv_free_blocks", "kv_total_blocks")
_FLOAT_FIELDS = ("started_at", "reported_at")


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One snapshot of a replica. ``cached_block_hashes`` is the replica's whole prefix cache at
    ``reported_at``: a hash absent from it is not cached there (it was evicted or never held)."""

    replica_id: str
    started_at: float
    block_size: int
    num_running: int
    num_waiting: int
    kv_free_blocks: int
    kv_total_blocks: int
    cached_block_hashes: frozenset[int]
    reported_at: float
    num_pending_prefill_tokens: int = 0
    transfer_cost_ratio: float | None = None
    cross_node_transfer_cost_ratio: float | None = None
    node_id: str | None = None
    decode_step_s: float | None = None

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> ReplicaReport:
        """Validate a stats dict; raises ValueError naming the first bad or missing key."""
        missing = [
            k
            for k in ("replica_id", "cached_block_hashes", *_INT_FIELDS, *_FLOAT_FIELDS)
            if k not in stats
        ]
        if missing:
            raise ValueError(f"routing stats: missing key(s) {', '.join(missing)}")
        for key in _INT_FIELDS:
            value = stats[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"routing stats: {key} must be a non-negative int, got {value!r}")
        for key in _FLOAT_FIELDS:
            value = stats[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"routing stats: {key} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"routing stats: {key} must be finite, got {value!r}")
        pending = stats.get("num_pending_prefill_tokens", 0)
        if not isinstance(pending, int) or isinstance(pending, bool) or pending < 0:
            raise ValueError(
                f"routing stats: num_pending_prefill_tokens must be a non-negative int, got {pending!r}"
            )
        ratio = _optional_ratio(stats, "transfer_cost_ratio")
        cross_ratio = _optional_ratio(stats, "cross_node_transfer_cost_ratio")
        decode_step_s = _optional_ratio(stats, "decode_step_s")
        node_id = stats.get("node_id")
        if node_id is not None and (not isinstance(node_id, str) or not node_id):
            raise ValueError(f"routing stats: node_id must be a non-empty string, got {node_id!r}")
        hashes = stats["cached_block_hashes"]
        if isinstance(hashes, str | bytes) or not hasattr(hashes, "__iter__"):
            raise ValueError("routing stats: cached_block_hashes must be a list of ints")
        return cls(
            replica_id=str(stats["replica_id"]),
            started_at=float(stats["started_at"]),
            block_size=stats["block_size"],
            num_running=stats["num_running"],
            num_waiting=stats["num_waiting"],
            kv_free_blocks=stats["kv_free_blocks"],
            kv_total_blocks=stats["kv_total_blocks"],
            cached_block_hashes=frozenset(hashes),
            reported_at=float(stats["reported_at"]),
            num_pending_prefill_tokens=pending,
            transfer_cost_ratio=ratio,
            cross_node_transfer_cost_ratio=cross_ratio,
            node_id=node_id,
            decode_step_s=decode_step_s,
        )


def _optional_ratio(stats: Mapping[str, Any], key: str) -> float | None:
    """``stats[key]`` as a float, None when absent; raises ValueError naming the key unless it is
    a finite non-negative number."""
    ratio = stats.get(key)
    if ratio is None:
        return None
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, int | float)
        or not math.isfinite(ratio)
        or ratio < 0
    ):
        raise ValueError(f"routing stats: {key} must be a non-negative number, got {ratio!r}")
    return float(ratio)


MAX_REPORTED_SESSIONS = 65536


def report_sessions(stats: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The report's ``recent_sessions`` (empty when absent), validated: ``[session, blocks]``
    pairs; raises ValueError naming the key otherwise."""
    raw = stats.get("recent_sessions")
    if raw is None:
        return []
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, list | tuple):
        raise ValueError("routing stats: recent_sessions must be a list of [session, blocks]")
    if len(raw) > MAX_REPORTED_SESSIONS:
        raise ValueError(f"routing stats: recent_sessions holds over {MAX_REPORTED_SESSIONS}")
    out = []
    for entry in raw:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], int)
            or isinstance(entry[1], bool)
            or entry[1] < 0
        ):
            raise ValueError(
                f"routing stats: recent_sessions entries must be [session, blocks], got {entry!r}"
            )
        out.append((entry[0], entry[1]))
    return out
