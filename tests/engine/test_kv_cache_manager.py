"""KVCacheManager: prefix hits, all-or-nothing allocation, the watermark, caching computed blocks."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_root
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), block_size=BS, hash_root=hash_root("m"))


def prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit a request with its prefix hit and mark every prompt token computed."""
    hit, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_prefix_hit_of_whole_blocks():
    kv = KVCacheManager(16, BS)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    prefill(kv, first)
    assert len(kv.pool.cached) == 2
    second = make_request("b", list(range(9)) + [99, 98])
    blocks, num = kv.get_computed_blocks(second)
    assert num == 8
    assert blocks == kv.req_blocks["a"][:2]
    other = make_request("c", [5] + list(range(1, 12)))
    assert kv.get_computed_blocks(other) == ([], 0)


@pytest.mark.parametrize("length, expected", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_prefix_hit_is_capped_at_len_minus_one(length, expected):
    """Even when every block is cached, the last token is recomputed for its logits."""
    kv = KVCacheManager(16, BS)
    prefill(kv, make_request("a", list(range(16))))
    request = make_request("b", list(range(length)))
    _, num = kv.get_computed_blocks(request)
    assert num == expected


def test_no_hits_without_caching():
    kv = KVCacheManager(16, BS, enable_caching=False)
    prefill(kv, make_request("a", list(range(12))))
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    assert kv.block_ids("a") == [0, 1]
    b = make_request("b", list(range(100, 112)))  # needs 3 blocks, 2 free
    assert not kv.allocate_slots(b, 12)
    assert "b" not in kv.req_blocks
    assert kv.pool.num_free_blocks == 2
    # Growing a running request (its 8 tokens computed): also all or nothing.
    a.num_computed_tokens = 8
    assert not kv.allocate_slots(a, 12)
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate_slots(a, 8)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.pool.check_invariants()


def test_hit_blocks_in_the_free_queue_count_against_what_is_free():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))  # 2 full blocks + 1
    prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    # Hits both cached blocks (both free) and needs 3 new blocks: only 2 others remain.
    b = make_request("b", list(range(8)) + list(range(50, 59)))
    hit, num = kv.get_computed_blocks(b)
    assert num == 8
    assert not kv.allocate_slots(b, b.num_tokens - num, hit)
    assert all(block.ref_cnt == 0 for block in hit)
    assert kv.pool.num_free_blocks == 4
    kv.pool.check_invariants()
    # Two new blocks fit.
    c = make_request("c", list(range(8)) + list(range(50, 55)))
    hit, num = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num, hit)
    assert kv.req_blocks["c"][:2] == hit
    assert all(block.ref_cnt == 1 for block in hit)
    assert kv.pool.num_free_blocks == 0
    kv.pool.check_invariants()


def test_watermark_applies_only_when_asked():
    kv = KVCacheManager(10, BS, watermark=0.2)
    assert kv.watermark_blocks == 2
    big = make_request("big", list(range(36)))  # 9 blocks
    assert not kv.allocate_slots(big, 36, use_watermark=True)
    assert kv.allocate_slots(big, 32, use_watermark=True)
    big.num_computed_tokens = 32
    assert not kv.allocate_slots(big, 1, use_watermark=True)
    assert kv.allocate_slots(big, 4)
    assert kv.pool.num_free_blocks == 1


def test_only_fully_computed_blocks_are_cached():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 3
    kv.cache_computed_blocks(r)
    assert kv.pool.cached == {}
    r.num_computed_tokens = 6
    kv.cache_computed_blocks(r)
    assert list(kv.pool.cached) == r.block_hashes[:1]
    r.num_computed_tokens = 10
    kv.cache_computed_blocks(r)
    assert list(kv.pool.cached) == r.block_hashes[:2]
    # Generated tokens fill the partial block; it is cached once computed.
    r.append_output_token(42)
    r.append_output_token(43)
    assert len(r.block_hashes) == 3
    kv.cache_computed_blocks(r)
    assert len(kv.pool.cached) == 2
    assert kv.allocate_slots(r, 2)
    r.num_computed_tokens = 12
    kv.cache_computed_blocks(r)
    assert list(kv.pool.cached) == r.block_hashes
    assert [kv.pool.cached[h].block_id for h in r.block_hashes] == kv.block_ids("a")
    kv.pool.check_invariants()


def test_duplicate_block_stays_uncached():
    """Two requests computing the same prefix at once: the second keeps its copy uncached."""
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))
    assert kv.allocate_slots(a, 6) and kv.allocate_slots(b, 6)
    for r in (a, b):
        r.num_computed_tokens = 6
        kv.cache_computed_blocks(r)
    assert kv.pool.cached[a.block_hashes[0]] is kv.req_blocks["a"][0]
    assert kv.req_blocks["b"][0].block_hash is None
    kv.free(a)
    kv.free(b)
    kv.pool.check_invariants()


def test_free_releases_tail_blocks_first():
    kv = KVCacheManager(6, BS)
    r = make_request("a", list(range(12)))
    prefill(kv, r)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(r)
    assert kv.pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    assert "a" not in kv.req_blocks
    assert kv.block_ids("a") == []
    kv.free(r)  # freeing twice is harmless
    kv.pool.check_invariants()


def test_shared_prefix_is_held_by_both_requests():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    b = make_request("b", list(range(9)))
    prefill(kv, b)
    assert kv.req_blocks["b"][:2] == kv.req_blocks["a"][:2]
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [2, 2, 1]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [1, 1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    # The shared blocks are still cached after both left.
    assert len(kv.get_computed_blocks(make_request("c", list(range(9))))[0]) == 2
    kv.pool.check_invariants()


def test_new_prefill_tokens_count_a_cached_or_already_counted_prefix_once():
    """What admitting a waiting request adds to the work ahead: its tokens less the leading
    blocks the cache holds or an earlier request's count holds; nothing is reused after the
    first block that neither holds."""
    kv = KVCacheManager(32, BS)
    prefill(kv, make_request("cached", list(range(8))))  # blocks [0..3], [4..7] cached
    counted: set = set()
    # 2 cached blocks, then 2 new ones and 2 tokens: 10 to compute.
    first = make_request("a", [*range(8), *range(100, 110)])
    assert kv.new_prefill_tokens(first, counted) == 10
    assert len(counted) == 2
    # The same 16 tokens as ``a``, then its own: everything but its last 3 tokens is held.
    assert (
        kv.new_prefill_tokens(make_request("b", [*range(8), *range(100, 108), 7, 8, 9]), counted)
        == 3
    )
    # Its first block differs: nothing after it is reused, though a later block's tokens match.
    other = make_request("c", [50, 51, 52, 53, *range(4, 8), *range(100, 104)])
    assert kv.new_prefill_tokens(other, counted) == 12
    # A whole prompt that is cached still computes its last token (for its logits).
    assert kv.new_prefill_tokens(make_request("d", list(range(8))), set()) == 4
    off = KVCacheManager(32, BS, enable_caching=False)
    assert off.new_prefill_tokens(make_request("e", list(range(8))), set()) == 8
