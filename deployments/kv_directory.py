"""The KV directory: which prefix blocks live in Ray's object store, and where.

One actor per application. An entry maps a block hash to the object holding that block's KV (a
run of blocks is one object; the entry records the block's index in it), its size, the replica
that computed and owns it, and when it was last used.

Invariants:
* ``used_bytes`` is the sum of the entries' ``nbytes`` and never exceeds ``capacity_bytes`` after
  a ``publish`` returns: the oldest entries (by last use under LRU, by publication under FIFO)
  are dropped first.
* The directory holds the object references, inside lists so Ray does not resolve them. An
  object lives while any entry refers to it; its owner is the publishing replica, so when that
  replica dies the object is lost: ``forget_owner`` (called when a replica stops reporting, or by
  a reader whose fetch failed) drops every entry it owned.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import ray


@dataclass
class Entry:
    ref: list[Any]  # [ObjectRef] to a block-major array of a run of blocks
    index: int  # this block's position in that run
    nbytes: int
    owner: str
    last_access: float


class KVDirectoryState:
    def __init__(
        self,
        capacity_bytes: int = 2 << 30,
        eviction: Literal["lru", "fifo"] = "lru",
        owner_timeout_s: float = 15.0,
    ) -> None:
        if eviction not in ("lru", "fifo"):
            raise ValueError(f"eviction: must be lru or fifo, got {eviction!r}")
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self.owner_timeout_s = owner_timeout_s
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.used_bytes = 0
        self.heartbeats: dict[str, float] = {}
        self.counters = {"published": 0, "evicted": 0, "dropped_dead": 0, "hits": 0, "lookups": 0}

    # -- writers ---------------------------------------------------------------------------------
    def publish(self, owner: str, hashes: list[int], ref: list[Any], block_nbytes: int) -> int:
        """Register ``hashes[i]`` as block ``i`` of the object ``ref[0]``. Hashes already present
        keep their existing entry. Returns how many were added."""
        now = time.time()
        self.heartbeats[owner] = now
        added = 0
        for i, h in enumerate(hashes):
            if h in self.entries:
                continue
            self.entries[h] = Entry(ref, i, block_nbytes, owner, now)
            self.used_bytes += block_nbytes
            added += 1
        self.counters["published"] += added
        self._evict()
        return added

    def heartbeat(self, owner: str) -> None:
        self.heartbeats[owner] = time.time()
        self._expire_owners()

    def forget_owner(self, owner: str) -> int:
        """Drop every entry of a replica that died (its objects are gone with it)."""
        self.heartbeats.pop(owner, None)
        dead = [h for h, e in self.entries.items() if e.owner == owner]
        for h in dead:
            self.used_bytes -= self.entries.pop(h).nbytes
        self.counters["dropped_dead"] += len(dead)
        return len(dead)

    def drop(self, hashes: list[int]) -> None:
        for h in hashes:
            e = self.entries.pop(h, None)
            if e is not None:
                self.used_bytes -= e.nbytes

    # -- readers ---------------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[tuple[int, list[Any], int, str]]:
        """The longest leading run of ``hashes`` present: ``(hash, [ref], index, owner)`` each."""
        self._expire_owners()
        self.counters["lookups"] += 1
        now = time.time()
        out = []
        for h in hashes:
            e = self.entries.get(h)
            if e is None:
                break
            out.append((h, e.ref, e.index, e.owner))
            e.last_access = now
            if self.eviction == "lru":
                self.entries.move_to_end(h)
        self.counters["hits"] += len(out)
        return out

    def contains(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` are present (no use recorded)."""
        n = 0
        for h in hashes:
            if h not in self.entries:
                break
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        owners: dict[str, int] = {}
        for e in self.entries.values():
            owners[e.owner] = owners.get(e.owner, 0) + 1
        return {
            "entries": len(self.entries),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "eviction": self.eviction,
            "owners": owners,
            **self.counters,
        }

    def hashes(self) -> list[int]:
        """Every hash present, oldest (next to evict) first."""
        return list(self.entries)

    # -- internals -------------------------------------------------------------------------------
    def _evict(self) -> None:
        while self.used_bytes > self.capacity_bytes and self.entries:
            _, e = self.entries.popitem(last=False)
            self.used_bytes -= e.nbytes
            self.counters["evicted"] += 1

    def _expire_owners(self) -> None:
        now = time.time()
        for owner, seen in list(self.heartbeats.items()):
            if now - seen > self.owner_timeout_s:
                self.forget_owner(owner)


# The actor; KVDirectoryState itself is plain Python so its logic is testable without Ray.
KVDirectory = ray.remote(num_cpus=0)(KVDirectoryState)
