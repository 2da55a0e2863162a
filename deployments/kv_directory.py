"""The KV directory: which prefix blocks live in Ray's object store, and where.

One actor per application. A replica publishes a run of blocks as one object (at most
``KVSharingArgs.max_blocks_per_object`` blocks); an entry maps a block hash to that object and
the block's index in it. Every object records the layout of its blocks (dtype and block shape),
its size, the replica that computed and owns it, and the Ray node that replica runs on (an
importer on that node reads the object from its own node's object store; one elsewhere fetches
it across nodes, which costs more).

Invariants:

* ``used_bytes`` is the sum of the *objects'* sizes, which is what the object store pins while
  the directory holds their references; it never exceeds ``capacity_bytes`` after ``publish``
  returns. Eviction drops whole objects: when the oldest entry (by last use under LRU, by
  publication under FIFO) goes, every entry of its object goes with it, so no surviving entry
  pins bytes the budget does not count.
* An object is kept only while at least one entry refers to it. The directory holds the
  references inside lists so Ray does not resolve them.
* The owner of an object is the publishing replica: when it dies the object is lost, so
  ``forget_owner`` (a replica stopped heartbeating) drops all it owned, and ``drop_objects``
  (a reader failed to fetch one) drops just those.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import ray


@dataclass(frozen=True)
class BlockLayout:
    """What the blocks of an object are: ``dtype`` (torch's name) and one block's shape."""

    dtype: str
    block_shape: tuple[int, ...]


@dataclass
class StoredObject:
    ref: list[Any]  # [ObjectRef] to a block-major array of a run of blocks
    nbytes: int  # the whole object's, skipped blocks included
    block_nbytes: int
    owner: str
    layout: BlockLayout
    hashes: list[int]  # the entries that refer to it
    node_id: str | None = None  # the owner's Ray node (None: not said)


@dataclass
class Entry:
    object_id: int
    index: int  # this block's position in the object
    last_access: float


@dataclass(frozen=True)
class Located:
    """One block found by ``lookup``."""

    block_hash: int
    object_id: int
    ref: list[Any]
    index: int
    owner: str
    layout: BlockLayout
    block_nbytes: int
    node_id: str | None = None  # the publishing replica's Ray node (None: not said)


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
        self.objects: dict[int, StoredObject] = {}
        self.used_bytes = 0
        self.heartbeats: dict[str, float] = {}
        self._ids = itertools.count()
        self.counters = {
            "published": 0,
            "evicted": 0,
            "dropped_dead": 0,
            "dropped_failed": 0,
            "hits": 0,
            "lookups": 0,
        }

    # -- writers ---------------------------------------------------------------------------------
    def publish(
        self,
        owner: str,
        hashes: list[int],
        ref: list[Any],
        block_nbytes: int,
        layout: BlockLayout,
        node_id: str | None = None,
    ) -> int:
        """Register ``hashes[i]`` as block ``i`` of the object ``ref[0]``, put by ``owner`` on
        the Ray node ``node_id``. Hashes already present keep their existing entry; an object
        that adds none (or is larger than the whole budget) is not kept. Returns how many
        entries were added."""
        now = time.time()
        self.heartbeats[owner] = now
        new = [(i, h) for i, h in enumerate(hashes) if h not in self.entries]
        nbytes = block_nbytes * len(hashes)
        if not new or nbytes > self.capacity_bytes:
            return 0
        object_id = next(self._ids)
        self.objects[object_id] = StoredObject(
            ref, nbytes, block_nbytes, owner, layout, [h for _, h in new], node_id
        )
        self.used_bytes += nbytes
        for i, h in new:
            self.entries[h] = Entry(object_id, i, now)
        self.counters["published"] += len(new)
        self._evict()
        return len(new)

    def heartbeat(self, owner: str) -> None:
        self.heartbeats[owner] = time.time()
        self._expire_owners()

    def forget_owner(self, owner: str) -> int:
        """Drop every object of a replica that died (its objects are gone with it). Returns how
        many entries went."""
        self.heartbeats.pop(owner, None)
        dead = [oid for oid, o in self.objects.items() if o.owner == owner]
        n = sum(self._drop_object(oid) for oid in dead)
        self.counters["dropped_dead"] += n
        return n

    def drop_objects(self, object_ids: list[int]) -> int:
        """Drop objects a reader could not fetch (lost or unreachable)."""
        n = sum(self._drop_object(oid) for oid in object_ids)
        self.counters["dropped_failed"] += n
        return n

    # -- readers ---------------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[Located]:
        """The longest leading run of ``hashes`` present."""
        self._expire_owners()
        self.counters["lookups"] += 1
        now = time.time()
        out = []
        for h in hashes:
            e = self.entries.get(h)
            if e is None:
                break
            o = self.objects[e.object_id]
            out.append(
                Located(
                    h, e.object_id, o.ref, e.index, o.owner, o.layout, o.block_nbytes, o.node_id
                )
            )
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

    def node_of(self, block_hash: int) -> str | None:
        """The Ray node the object holding ``block_hash`` was published on (None: absent or not
        said); no use recorded."""
        e = self.entries.get(block_hash)
        return None if e is None else self.objects[e.object_id].node_id

    def stats(self) -> dict[str, Any]:
        owners: dict[str, int] = {}
        for o in self.objects.values():
            owners[o.owner] = owners.get(o.owner, 0) + len(o.hashes)
        return {
            "entries": len(self.entries),
            "objects": len(self.objects),
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
    def _drop_object(self, object_id: int) -> int:
        o = self.objects.pop(object_id, None)
        if o is None:
            return 0
        self.used_bytes -= o.nbytes
        n = 0
        for h in o.hashes:
            e = self.entries.get(h)
            if e is not None and e.object_id == object_id:
                del self.entries[h]
                n += 1
        return n

    def _evict(self) -> None:
        while self.used_bytes > self.capacity_bytes and self.entries:
            oldest = next(iter(self.entries.values()))
            self.counters["evicted"] += self._drop_object(oldest.object_id)

    def _expire_owners(self) -> None:
        now = time.time()
        for owner, seen in list(self.heartbeats.items()):
            if now - seen > self.owner_timeout_s:
                self.forget_owner(owner)


# The actor; KVDirectoryState itself is plain Python so its logic is testable without Ray.
KVDirectory = ray.remote(num_cpus=0)(KVDirectoryState)
