"""Maps requests to KV blocks on top of a BlockPool.

Ownership: ``req_blocks[request_id]`` is the request's block table, in token order; the request
holds one reference on each of those blocks until ``free``. Blocks shared through a prefix hit are
held by every request that hit them.

A request's block ``i`` gets its hash registered (``cache_computed_blocks``) once its tokens are
all computed, i.e. ``num_computed_tokens >= (i + 1) * block_size``. Blocks shared from a request
that computes them in the same step (``engine.step_sharing``) count as computed from admission on
and are registered after that step, like the ones the request computes itself.
"""

from __future__ import annotations

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks that prefixes the request's tokens, and the number of
        tokens they cover. Capped so that at least the last token is recomputed for its logits."""
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def new_prefill_tokens(self, request: Request, counted: set[BlockHash]) -> int:
        """Prompt tokens that admitting the waiting ``request`` adds to the work ahead: its
        tokens less the leading full blocks that are cached or that an earlier request's count
        already holds (``counted``, to which this request's other full blocks are added: a step
        that admits both computes them once, ``engine.step_sharing``). An estimate for sizing a
        step; hashes are chained, so a counted block implies its whole prefix."""
        todo = request.num_prefill_tokens_left
        if not self.enable_caching or request.skips_prefix_cache or request.num_computed_tokens:
            return todo
        reusing = True
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            if reusing and (
                block_hash in counted or self.pool.get_cached_block(block_hash) is not None
            ):
                todo -= self.block_size
                continue
            reusing = False
            counted.add(block_hash)
        return todo

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        use_watermark: bool = False,
        shared_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens (after its computed tokens,
        any newly hit ``computed_blocks`` and then any ``shared_blocks``: blocks another request
        computes in the same step, ``engine.step_sharing``). All or nothing: returns False and
        changes nothing when the pool cannot supply them (keeping the watermark free, for new
        requests)."""
        computed_blocks = computed_blocks or []
        shared_blocks = shared_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_reused = len(computed_blocks) + len(shared_blocks)
        num_computed = request.num_computed_tokens + num_reused * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(blocks) - num_reused
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        num_hit_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        available = self.pool.num_free_blocks - num_hit_free
        if use_watermark:
            available -= self.watermark_blocks
        if num_new_blocks > available:
            return False
        if request.request_id not in self.req_blocks:
            self.req_blocks[request.request_id] = blocks
            self._num_cached_blocks[request.request_id] = 0
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        if shared_blocks:
            # Held by their computing request (never free); not yet registered, so this
            # request's cache_computed_blocks covers them too (a no-op once the leader has).
            self.pool.touch(shared_blocks)
            blocks.extend(shared_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the hashes of blocks whose tokens are now all computed."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            return
        start = self._num_cached_blocks[request.request_id]
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if end > start:
            self._num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release every block of the request; the tail blocks become the first to be evicted, so
        the shared head of a prefix stays cached longest."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def usage(self) -> float:
        return self.pool.usage()
