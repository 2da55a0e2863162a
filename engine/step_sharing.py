"""Same-step prefix sharing: a request admitted in a step reads the full blocks that requests
scheduled earlier in that step compute completely in it.

A block's hash enters the prefix cache only once its KV is written (``engine.block_pool``), so
without this a burst of requests behind one new prefix would see the prefix "in flight" and wait a
step for it (``engine.scheduler``, 3.). vLLM instead makes a block findable when it is allocated;
here, while a step is being built, :class:`StepBlocks` maps the hash of every full block that a
request of the step completes in the step (its chunk's end covers the whole block) to that block,
and admission extends a request's prefix-cache hit with those blocks: shared like a hit (one more
reference each), counted as computed and as cached tokens.

Why the follower may read them in the very step that writes them (the invariant every attention
path keeps, ``engine.attention.base.AttentionBackend``): within each layer, every token's K/V of
the step is written to the cache before any attention of that layer reads the cache. The leader's
tokens of a shared block are in the same step, so by the time the follower's queries attend in a
layer, the block holds that layer's K/V of every one of its tokens.

Bookkeeping stays as for a prefix hit: the blocks' hashes are registered after the step by
``KVCacheManager.cache_computed_blocks``, by the leader (scheduled before the follower) and, a
no-op then, by the follower, whose own count of registered blocks stops before the shared ones
(``KVCacheManager.allocate_slots``). Each holder frees its own reference whenever it leaves.

Only a step planned ahead can lose a leader before it runs (an abort between steps,
``engine.step_pipeline``); the scheduler then withdraws every admission that was to read the
leader's blocks (``SchedulerOutput.shared_from``, ``Scheduler.drop_finished``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_hash import BlockHash
from engine.block_pool import KVCacheBlock
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request


@dataclass
class SharedRun:
    """Blocks a request reads from others of its step, after its prefix hit, and the requests
    computing them (each named once, in block order)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    leaders: list[Request] = field(default_factory=list)


class StepBlocks:
    """The full blocks completed by the step being built, by hash (the first request to compute
    a hash in the step keeps it)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._blocks: dict[BlockHash, tuple[KVCacheBlock, Request]] = {}

    def add(self, request: Request, num_new_tokens: int) -> None:
        """Record the blocks that ``request``'s chunk (``num_new_tokens`` after its
        ``num_computed_tokens``, already allocated) completes. Blocks whose tokens are still
        being sampled have no hash yet and are left out."""
        bs = self.kv.block_size
        start = request.num_computed_tokens
        end = min((start + num_new_tokens) // bs, len(request.block_hashes))
        blocks = self.kv.req_blocks[request.request_id]
        for i in range(start // bs, end):
            self._blocks.setdefault(request.block_hashes[i], (blocks[i], request))

    def extend(self, request: Request, num_hit_blocks: int) -> SharedRun:
        """The consecutive blocks after the request's ``num_hit_blocks`` cached ones that this
        step completes, capped as a prefix hit is (``get_computed_blocks``), so that the
        request still computes its last token."""
        limit = (request.num_tokens - 1) // self.kv.block_size
        run = SharedRun()
        for block_hash in request.block_hashes[num_hit_blocks:limit]:
            found = self._blocks.get(block_hash)
            if found is None:
                break
            block, leader = found
            run.blocks.append(block)
            if leader not in run.leaders:
                run.leaders.append(leader)
        return run
