"""KV sharing in the simulator: the live directory's state, and the replicas' publish/import rules.

The directory is ``deployments.kv_directory.KVDirectoryState`` itself (LRU, bounded capacity),
with every block counted as one byte so that its byte capacity is a block count. The publish and
import rules mirror ``deployments.kv_sharing.KVSharing``:

- publish, when a request's prompt is fully computed: the prompt's full blocks from block 0, if
  the request computed at least ``min_blocks`` of them itself; the directory skips the leading
  run it already holds, and only the blocks still cached on the replica are published, as
  objects of at most ``max_blocks_per_object`` blocks (the directory evicts whole objects);
- import, when a request reaches a replica: the run of blocks the directory holds right after
  the replica's local prefix hit (within the first ``(prompt_len - 1) // block_size`` blocks), if
  at least ``min_blocks`` long. The request joins the replica's queue after the transfer time,
  with those blocks installed as free cached blocks (see ``SimReplica.install``).

Nodes: each object records its publisher's node, as live. ``located`` is the router's hint with
those nodes (``router.topology.BlockLocations``), and ``cross_node_blocks`` says how many of an
import's blocks come from another node's object store (they take longer to fetch).

Differences from the live system, all in the directory's favour: publishing is instantaneous
(live, a background task exports and puts the blocks within tens of milliseconds), and an entry
never disappears because its owner died.
"""

from __future__ import annotations

import math
from collections.abc import Container
from typing import TYPE_CHECKING

from benchmarks.sim.replica import SimReplica, SimRequest

if TYPE_CHECKING:
    from deployments.kv_directory import KVDirectoryState


class SimDirectory:
    def __init__(
        self, capacity_blocks: int, min_blocks: int = 4, max_blocks_per_object: int = 32
    ) -> None:
        # Imported lazily: the module imports ray (~1 s), needed only with KV sharing.
        from deployments.kv_directory import BlockLayout, KVDirectoryState

        if capacity_blocks < 1 or min_blocks < 1:
            raise ValueError("directory capacity and min_blocks must be >= 1")
        # No owner ever times out: the simulated clock is not time.time().
        self.state = KVDirectoryState(
            capacity_bytes=capacity_blocks, eviction="lru", owner_timeout_s=math.inf
        )
        self.min_blocks = min_blocks
        self.max_blocks_per_object = max_blocks_per_object
        self.layout = BlockLayout("simulated", ())
        self.imported_blocks = 0
        self.imported_cross_node_blocks = 0
        self.imports = 0

    @property
    def hashes(self) -> Container[int]:
        """Every hash the directory holds (what the router's ``directory_hashes`` asks for)."""
        return self.state.entries

    @property
    def located(self) -> _Located:
        """The directory's hashes with the node each was published on."""
        return _Located(self.state)

    def cross_node_blocks(self, node_id: str | None, hashes: list[int]) -> int:
        """How many of ``hashes`` (present) a replica on ``node_id`` fetches from another node."""
        if node_id is None:
            return 0
        node_of = self.state.node_of
        return sum(1 for h in hashes if (n := node_of(h)) is not None and n != node_id)

    def publish(self, replica: SimReplica, request: SimRequest, node_id: str | None = None) -> int:
        """The replica (on ``node_id``) finished computing ``request``'s prompt. Returns blocks
        added."""
        block = replica.block_tokens
        first = max(request.num_cached_tokens, 0) // block
        last = request.num_prompt_tokens // block
        if last - first < self.min_blocks:
            return 0
        hashes = request.block_hashes[:last]
        known = self.state.contains(hashes)
        todo = hashes[known:]
        if len(todo) < self.min_blocks:
            return 0
        found = todo[: replica.local_prefix_blocks(todo)]
        if len(found) < self.min_blocks:
            return 0
        step = self.max_blocks_per_object
        return sum(
            self.state.publish(
                replica.replica_id, found[i : i + step], [None], 1, self.layout, node_id
            )
            for i in range(0, len(found), step)
        )

    def plan_import(self, replica: SimReplica, request: SimRequest) -> list[int]:
        """Hashes to import for ``request`` on ``replica`` (empty: nothing worth importing).
        Looking them up refreshes them in the directory's LRU, as a live lookup does."""
        usable = request.block_hashes[: (request.num_prompt_tokens - 1) // replica.block_tokens]
        wanted = usable[replica.local_prefix_blocks(usable) :]
        if len(wanted) < self.min_blocks:
            return []
        entries = self.state.lookup(wanted)
        if len(entries) < self.min_blocks:
            return []
        return [loc.block_hash for loc in entries]


class _Located:
    """A ``router.topology.BlockLocations`` over the directory's current entries."""

    def __init__(self, state: KVDirectoryState) -> None:
        self._entries = state.entries
        self._node_of = state.node_of

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def nodes(self, block_hash: int) -> frozenset[str]:
        node = self._node_of(block_hash)
        return frozenset() if node is None else frozenset((node,))
