"""Where published KV blocks live, and what importing them costs a replica on a given node.

A replica imports a block the KV directory holds from the object store of the node that
published it. From the publisher's own node that is a read of shared memory; from another node
the bytes first cross object stores, which costs more. A directory hint that knows the
publishing nodes (``BlockLocations``) lets the router price each transferable block by whether
the candidate shares the node; a plain container of hashes prices them all as same-node imports,
as before nodes were known.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockLocations(Protocol):
    """A directory hint (a container of the block hashes the directory can supply) that also
    names the nodes each block was published on."""

    def __contains__(self, block_hash: object) -> bool: ...

    def nodes(self, block_hash: int) -> Collection[str]:
        """The Ray node ids ``block_hash`` was published on; empty when unknown (or absent)."""
        ...


@dataclass(frozen=True)
class PublishedBlocks:
    """A ``BlockLocations`` from a plain mapping: hash -> the nodes it was published on."""

    by_hash: Mapping[int, frozenset[str]] = field(default_factory=dict)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.by_hash

    def nodes(self, block_hash: int) -> Collection[str]:
        return self.by_hash.get(block_hash, frozenset())


def transfer_weights(
    prefill_cost_per_block: float,
    configured: float,
    same_node_ratio: float | None,
    cross_node_ratio: float | None,
) -> tuple[float, float]:
    """What importing one block costs a replica (block-prefill units): ``(same_node,
    cross_node)``, from its own node's object store and from another node's.

    Measured ratios (import seconds over prefill seconds per block) win over the configured
    weight. An unmeasured cross-node cost falls back to the same-node figure, itself the
    configured weight until measured: a replica that has only imported from its own node is
    priced as before nodes were known."""
    same = configured if same_node_ratio is None else prefill_cost_per_block * same_node_ratio
    cross = same if cross_node_ratio is None else prefill_cost_per_block * cross_node_ratio
    return same, cross


def remote_block_counts(
    block_hashes: Sequence[int],
    directory: Container[int] | None,
    nodes: Collection[str | None],
) -> dict[str, list[int]] | None:
    """For each node in ``nodes``: ``counts[node][i]`` is how many of ``block_hashes[:i]`` the
    directory holds on other nodes only (so a replica on ``node`` fetches them across object
    stores). Blocks whose publishing node is unknown count as local, as before nodes were
    known. None when the directory names no nodes or no node is known: price every transfer
    as same-node."""
    known = {n for n in nodes if n}
    if not known or not isinstance(directory, BlockLocations) or not block_hashes:
        return None
    where = [directory.nodes(h) if h in directory else () for h in block_hashes]
    counts: dict[str, list[int]] = {}
    for node in known:
        running = [0] * (len(block_hashes) + 1)
        for i, published in enumerate(where):
            remote = bool(published) and node not in published
            running[i + 1] = running[i] + remote
        counts[node] = running
    return counts
