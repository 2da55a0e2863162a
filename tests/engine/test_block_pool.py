"""BlockPool: exact block ids and free-queue order through allocate, free, hit and eviction."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(10)
    assert pool.free_queue.ids() == list(range(10))
    blocks = pool.allocate(3)
    assert ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.free_queue.ids() == list(range(3, 10))
    assert pool.num_free_blocks == 7
    assert pool.usage() == pytest.approx(0.3)
    pool.check_invariants()


def test_free_appends_to_the_tail_in_the_given_order():
    pool = BlockPool(10)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))
    assert pool.free_queue.ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    # Allocation takes from the head: the never-used blocks go first, then 2, 1, 0.
    assert ids(pool.allocate(8)) == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.free_queue.ids() == [1, 0]
    pool.check_invariants()


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.free_queue.ids() == [1, 2, 3]
    pool.free([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.ids() == [1, 2, 3, 0]
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.free_queue.ids() == [2]
    pool.check_invariants()


def test_cached_free_block_can_be_hit_from_the_middle_of_the_queue():
    pool = BlockPool(10)
    blocks = pool.allocate(3)
    for block, h in zip(blocks, (100, 101, 102), strict=True):
        assert pool.cache_block(block, h)
    pool.free(reversed(blocks))
    assert pool.free_queue.ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    # Freed blocks keep their hashes.
    assert [pool.get_cached_block(h) for h in (100, 101, 102)] == blocks

    hit = pool.get_cached_block(101)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.ids() == [3, 4, 5, 6, 7, 8, 9, 2, 0]
    assert pool.num_free_blocks == 9
    pool.check_invariants()


def test_allocation_evicts_the_head_hash():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], 100)
    pool.cache_block(blocks[1], 101)
    assert sorted(pool.cached_hashes()) == [100, 101]
    pool.free(reversed(blocks))
    assert pool.free_queue.ids() == [2, 3, 1, 0]

    assert ids(pool.allocate(2)) == [2, 3]  # never-cached blocks: nothing evicted
    assert sorted(pool.cached_hashes()) == [100, 101]
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == 1
    assert evicted.block_hash is None
    assert pool.get_cached_block(101) is None
    assert pool.get_cached_block(100) is blocks[0]
    assert pool.cached_hashes() == [100]
    pool.check_invariants()


def test_one_block_per_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    assert b.block_hash is None
    assert pool.get_cached_block(7) is a
    # Re-registering the block under its own hash is a no-op that succeeds.
    assert pool.cache_block(a, 7)
    assert pool.cached_hashes() == [7]
    pool.check_invariants()


def test_caching_disabled():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, 7)
    assert pool.get_cached_block(7) is None
    assert pool.cached_hashes() == []


def test_reset_prefix_cache_needs_every_block_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], 1)
    pool.cache_block(blocks[1], 2)
    assert not pool.reset_prefix_cache()
    assert sorted(pool.cached_hashes()) == [1, 2]
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached_hashes() == []
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_invariants()


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_free_queue_remove_and_popleft():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert queue.ids() == [1, 2]
    assert queue.popleft() is blocks[1]
    assert queue.num_free == 1
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])
    queue.popleft()
    with pytest.raises(RuntimeError, match="no free"):
        queue.popleft()
