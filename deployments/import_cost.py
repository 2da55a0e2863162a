"""What importing a published KV block costs a replica, measured separately by where the block's
object was published: on the replica's own Ray node (a read of its node's shared-memory object
store) or on another node (the object is first copied between object stores).

Both are moving averages of seconds per block over whole fetches; the router divides them by the
replica's prefill seconds per block (``ratios``) to price an import against a recompute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Weight of the newest fetch in each moving average.
ALPHA = 0.2


@dataclass
class ImportCost:
    """Seconds per imported block, by the publisher's node relative to ``node_id`` (this
    replica's). Invariant: an average is None until a fetch of its kind has been observed."""

    node_id: str | None
    same_node_s_per_block: float | None = None
    cross_node_s_per_block: float | None = None

    def crosses_nodes(self, publishers: Iterable[str | None]) -> bool:
        """Whether a fetch of objects published on ``publishers`` crosses nodes: some object came
        from a known node other than this replica's. A publisher of unknown node counts as
        local (as every import did before nodes were recorded), and so does every publisher
        while this replica's own node is unknown."""
        if self.node_id is None:
            return False
        return any(node is not None and node != self.node_id for node in publishers)

    def observe(self, seconds: float, blocks: int, publishers: Iterable[str | None]) -> None:
        """A fetch of ``blocks`` blocks from objects published on ``publishers`` took
        ``seconds`` (all its objects fetched concurrently). A fetch that mixes local and remote
        objects waits for the remote ones, so it counts as cross-node."""
        if blocks <= 0:
            return
        sample = seconds / blocks
        if self.crosses_nodes(publishers):
            self.cross_node_s_per_block = _average(self.cross_node_s_per_block, sample)
        else:
            self.same_node_s_per_block = _average(self.same_node_s_per_block, sample)

    def ratios(self, prefill_s_per_block: float | None) -> tuple[float | None, float | None]:
        """``(same_node, cross_node)`` import seconds over prefill seconds per block; each None
        until both of its figures have been measured."""
        if not prefill_s_per_block:
            return None, None
        return tuple(  # type: ignore[return-value]
            None if s is None else s / prefill_s_per_block
            for s in (self.same_node_s_per_block, self.cross_node_s_per_block)
        )


def _average(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + ALPHA * (sample - previous)
