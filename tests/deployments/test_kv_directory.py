"""The KV directory's bookkeeping: a byte budget over whole objects, LRU and FIFO eviction, dead
owners and failed objects."""

from __future__ import annotations

import random

import pytest

from deployments.kv_directory import BlockLayout, KVDirectoryState

LAYOUT = BlockLayout("float32", (2, 2, 16, 2, 16))


def _ref(name: str) -> list[str]:
    # Real entries hold [ObjectRef]; the directory never looks inside.
    return [name]


def _publish(d: KVDirectoryState, owner: str, hashes: list[int], name: str, nbytes: int) -> int:
    return d.publish(owner, hashes, _ref(name), nbytes, LAYOUT)


def test_capacity_and_lru_eviction_of_whole_objects() -> None:
    d = KVDirectoryState(capacity_bytes=400, eviction="lru")
    assert _publish(d, "a", [1, 2], "x", 100) == 2
    assert _publish(d, "a", [3, 4], "y", 100) == 2
    assert d.used_bytes == 400
    # A lookup of [1, 2] makes them the most recently used; object y (3, 4) is now the oldest.
    assert [loc.block_hash for loc in d.lookup([1, 2])] == [1, 2]
    _publish(d, "b", [5], "z", 100)
    # Evicting 3 frees its object: 4 goes with it, and the bytes counted are what stays pinned.
    assert d.hashes() == [1, 2, 5]
    assert d.used_bytes == 300
    assert d.stats()["evicted"] == 2 and d.stats()["objects"] == 2


def test_fifo_ignores_use() -> None:
    d = KVDirectoryState(capacity_bytes=400, eviction="fifo")
    _publish(d, "a", [1, 2], "x", 100)
    _publish(d, "a", [3, 4], "y", 100)
    d.lookup([1, 2])
    _publish(d, "a", [5, 6], "w", 100)
    assert d.hashes() == [3, 4, 5, 6]


def test_lookup_returns_leading_run_with_positions_and_layout() -> None:
    d = KVDirectoryState(capacity_bytes=10_000)
    _publish(d, "a", [10, 11, 12], "x", 10)
    _publish(d, "b", [13], "y", 10)
    run = d.lookup([10, 11, 12, 13, 99, 14])
    assert [(loc.block_hash, loc.ref, loc.index, loc.owner) for loc in run] == [
        (10, ["x"], 0, "a"),
        (11, ["x"], 1, "a"),
        (12, ["x"], 2, "a"),
        (13, ["y"], 0, "b"),
    ]
    assert all(loc.layout == LAYOUT and loc.block_nbytes == 10 for loc in run)
    assert d.contains([10, 11, 99]) == 2
    assert d.lookup([99, 10]) == []


def test_republishing_keeps_the_first_entry_and_counts_the_whole_object() -> None:
    d = KVDirectoryState(capacity_bytes=10_000)
    _publish(d, "a", [1, 2], "x", 10)
    assert _publish(d, "b", [1, 2, 3], "y", 10) == 1
    assert [loc.owner for loc in d.lookup([1, 2, 3])] == ["a", "a", "b"]
    # Object y pins all three of its blocks while its one entry lives.
    assert d.used_bytes == 20 + 30
    # An object that adds nothing is not kept.
    assert _publish(d, "c", [1, 2], "z", 10) == 0
    assert d.stats()["objects"] == 2


def test_object_larger_than_the_budget_is_refused() -> None:
    d = KVDirectoryState(capacity_bytes=100)
    assert _publish(d, "a", [1, 2, 3], "x", 40) == 0
    assert d.used_bytes == 0 and d.hashes() == []


def test_dead_owners_and_failed_objects_are_dropped() -> None:
    d = KVDirectoryState(capacity_bytes=10_000, owner_timeout_s=60.0)
    _publish(d, "a", [1, 2], "x", 10)
    _publish(d, "b", [3], "y", 10)
    _publish(d, "b", [4], "w", 10)
    assert d.forget_owner("a") == 2
    assert d.hashes() == [3, 4] and d.used_bytes == 20
    # A failed fetch drops that object only; its owner's others stay.
    (loc,) = d.lookup([3])
    assert d.drop_objects([loc.object_id]) == 1
    assert d.hashes() == [4] and d.used_bytes == 10
    # An owner that stops heartbeating is dropped on the next lookup.
    d.heartbeats["b"] -= 61.0
    assert d.lookup([4]) == []
    stats = d.stats()
    assert stats["entries"] == 0 and stats["objects"] == 0 and d.used_bytes == 0
    assert stats["dropped_dead"] == 3 and stats["dropped_failed"] == 1


def test_budget_holds_for_pinned_bytes_under_random_publish_and_evict() -> None:
    """``used_bytes`` always equals the bytes of the objects still referenced (what the object
    store pins) and stays within the budget, whatever the mix of publishes and lookups."""
    rng = random.Random(7)
    d = KVDirectoryState(capacity_bytes=5_000, eviction="lru")
    sizes: dict[str, int] = {}
    for step in range(3_000):
        if rng.random() < 0.6:
            n = rng.randrange(1, 9)
            start = rng.randrange(0, 400)
            name = f"obj{step}"
            nbytes = rng.choice((50, 100, 150))
            sizes[name] = n * nbytes
            _publish(d, rng.choice("abc"), list(range(start, start + n)), name, nbytes)
        else:
            start = rng.randrange(0, 400)
            d.lookup(list(range(start, start + rng.randrange(1, 12))))
        pinned = {o.ref[0] for o in d.objects.values()}
        assert d.used_bytes == sum(sizes[name] for name in pinned) <= d.capacity_bytes
        assert {d.objects[e.object_id].ref[0] for e in d.entries.values()} == pinned


def test_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="eviction"):
        KVDirectoryState(eviction="random")  # type: ignore[arg-type]


def test_every_object_records_its_publishers_node() -> None:
    d = KVDirectoryState(capacity_bytes=1000)
    d.publish("a", [1, 2], _ref("x"), 100, LAYOUT, "node-1")
    d.publish("b", [2, 3], _ref("y"), 100, LAYOUT, "node-2")  # 2 keeps a's entry
    _publish(d, "c", [4], "z", 100)  # a publisher that does not say its node
    assert [(loc.block_hash, loc.node_id) for loc in d.lookup([1, 2, 3, 4])] == [
        (1, "node-1"),
        (2, "node-1"),
        (3, "node-2"),
        (4, None),
    ]
    assert [d.node_of(h) for h in (1, 3, 4, 5)] == ["node-1", "node-2", None, None]
