"""An engine replica's routing stats: the report Serve polls through the replica's
``record_routing_stats`` and hands to the request router (contract and validation:
``router.report``).

Invariants: ``routing_snapshot`` runs on the engine thread, where the scheduler's queues and the
block pool agree with each other; ``cached_block_hashes`` is the whole prefix cache (a full
snapshot, never a delta); the transfer cost ratios are None without KV sharing. The replica's
``recent_sessions`` are not part of it: they are read on the event loop that updates them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deployments.kv_sharing import KVSharing
    from engine.llm_engine import LLMEngine


def routing_snapshot(
    engine: LLMEngine,
    replica_id: str,
    started_at: float,
    node_id: str,
    kv_sharing: KVSharing | None,
) -> dict[str, Any]:
    """``engine``'s state as ``router.report.ReplicaReport`` reads it, taken now."""
    same, cross = (None, None) if kv_sharing is None else kv_sharing.transfer_cost_ratios()
    return {
        "replica_id": replica_id,
        "started_at": started_at,
        "block_size": engine.block_size,
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "num_pending_prefill_tokens": engine.scheduler.num_pending_prefill_tokens,
        "kv_free_blocks": engine.kv.pool.num_free_blocks,
        "kv_total_blocks": engine.kv.pool.num_blocks,
        "cached_block_hashes": engine.kv.pool.cached_hashes(),
        "reported_at": time.time(),
        "transfer_cost_ratio": same,
        "cross_node_transfer_cost_ratio": cross,
        "node_id": node_id,
        # Stale once nothing runs: a new stream would be the only one.
        "decode_step_s": engine.stats.decode_step_s if engine.scheduler.num_running else None,
    }
