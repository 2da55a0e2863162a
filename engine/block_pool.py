"""A fixed pool of KV blocks with reference counts and a hash-addressed prefix cache.

Invariants (checked by ``check_invariants`` in tests):

| state                 | ref_cnt | in free queue | block_hash                 |
|-----------------------|---------|---------------|----------------------------|
| held by requests      | > 0     | no            | None, or its cached hash   |
| free, never full      | 0       | yes           | None                       |
| free, still cached    | 0       | yes           | set (can be hit and reused)|

* ``block.block_hash is not None`` if and only if ``cached[block.block_hash] is block``: one block
  per hash. A request that computes a block whose hash is already cached keeps its own copy
  uncached.
* A block's hash is set only once all ``block_size`` tokens of its KV have been written.
* The free queue is ordered by eviction priority: ``allocate`` takes from the head (least recently
  freed), ``free`` appends to the tail. A hit on a free cached block takes it out of the queue
  wherever it is (O(1), doubly linked).
* Allocating a free cached block evicts its hash (routers learn it from the next report of the
  cached hashes).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.block_hash import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV tensor."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, head = next to evict."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cached_hashes(self) -> list[BlockHash]:
        return list(self.cached)

    # -- transitions -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit), un-freeing free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching zero join the
        tail of the free queue (so the first given is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a block whose KV is fully written under ``block_hash``. Returns False when the
        hash is already cached by another block (this one then stays uncached)."""
        if not self.enable_caching or block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free_ids = set(self.free_queue.ids())
        assert len(free_ids) == self.free_queue.num_free
        for block in self.blocks:
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
            assert block.ref_cnt >= 0, block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        assert all(b.block_hash == h for h, b in self.cached.items())
