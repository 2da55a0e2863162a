"""The KV directory's bookkeeping: capacity in bytes, LRU and FIFO eviction, dead owners."""

from __future__ import annotations

import pytest

from deployments.kv_directory import KVDirectoryState


def _ref(name: str) -> list[str]:
    # Real entries hold [ObjectRef]; the directory never looks inside.
    return [name]


def test_capacity_and_lru_eviction() -> None:
    d = KVDirectoryState(capacity_bytes=400, eviction="lru")
    assert d.publish("a", [1, 2], _ref("x"), block_nbytes=100) == 2
    assert d.publish("a", [3, 4], _ref("y"), block_nbytes=100) == 2
    assert d.used_bytes == 400
    # A lookup of [1, 2] makes them the most recently used; 3 and 4 are now the oldest.
    assert [h for h, *_ in d.lookup([1, 2])] == [1, 2]
    d.publish("b", [5], _ref("z"), block_nbytes=100)
    assert d.hashes() == [4, 1, 2, 5]
    assert d.used_bytes == 400
    assert d.stats()["evicted"] == 1


def test_fifo_ignores_use() -> None:
    d = KVDirectoryState(capacity_bytes=400, eviction="fifo")
    d.publish("a", [1, 2, 3, 4], _ref("x"), block_nbytes=100)
    d.lookup([1, 2])
    d.publish("a", [5, 6], _ref("y"), block_nbytes=100)
    assert d.hashes() == [3, 4, 5, 6]


def test_lookup_returns_leading_run_with_positions() -> None:
    d = KVDirectoryState(capacity_bytes=10_000)
    d.publish("a", [10, 11, 12], _ref("x"), block_nbytes=10)
    d.publish("b", [13], _ref("y"), block_nbytes=10)
    run = d.lookup([10, 11, 12, 13, 99, 14])
    assert [(h, ref, i, owner) for h, ref, i, owner in run] == [
        (10, ["x"], 0, "a"),
        (11, ["x"], 1, "a"),
        (12, ["x"], 2, "a"),
        (13, ["y"], 0, "b"),
    ]
    assert d.contains([10, 11, 99]) == 2
    assert d.lookup([99, 10]) == []


def test_republishing_keeps_the_first_entry() -> None:
    d = KVDirectoryState(capacity_bytes=10_000)
    d.publish("a", [1, 2], _ref("x"), block_nbytes=10)
    assert d.publish("b", [1, 2, 3], _ref("y"), block_nbytes=10) == 1
    assert [owner for *_, owner in d.lookup([1, 2, 3])] == ["a", "a", "b"]
    assert d.used_bytes == 30


def test_dead_owners_are_forgotten() -> None:
    d = KVDirectoryState(capacity_bytes=10_000, owner_timeout_s=0.0)
    d.publish("a", [1, 2], _ref("x"), block_nbytes=10)
    d.publish("b", [3], _ref("y"), block_nbytes=10)
    assert d.forget_owner("a") == 2
    assert d.hashes() == [3] and d.used_bytes == 10
    # An owner that stops heartbeating is dropped on the next lookup.
    d.heartbeats["b"] = 0.0
    assert d.lookup([3]) == []
    assert d.stats()["entries"] == 0 and d.stats()["dropped_dead"] == 3


def test_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="eviction"):
        KVDirectoryState(eviction="random")  # type: ignore[arg-type]
