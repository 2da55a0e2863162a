"""Moving prefix KV blocks in and out of an engine, keyed by block hash.

Both functions must run on the engine's own thread (between steps), where the block pool is
consistent. The exchanged layout is block-major, ``[n, layers, 2, block_size, kv_heads, head_dim]``,
so each block is one contiguous slice and a run can be split or joined without copying.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.block_hash import BlockHash
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner


class KVLayoutError(ValueError):
    """Imported KV does not match this engine's layout (dtype or block shape)."""


def block_shape(runner: ModelRunner) -> tuple[int, ...]:
    """The shape of one exported block: ``[layers, 2, block_size, kv_heads, head_dim]``."""
    k, _ = runner.kv_caches[0]
    return (len(runner.kv_caches), 2, *k.shape[1:])


def export_blocks(
    kv: KVCacheManager, runner: ModelRunner, hashes: list[BlockHash]
) -> tuple[list[BlockHash], torch.Tensor]:
    """The KV of the longest leading run of ``hashes`` still cached here (a CPU copy)."""
    found: list[BlockHash] = []
    ids: list[int] = []
    for h in hashes:
        block = kv.pool.get_cached_block(h)
        if block is None:
            break
        found.append(h)
        ids.append(block.block_id)
    if not ids:
        return [], torch.empty(0)
    data = runner.read_blocks(ids)  # [layers, 2, n, bs, heads, dim]
    return found, data.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def check_layout(
    runner: ModelRunner, hashes: Sequence[BlockHash], chunks: list[torch.Tensor]
) -> None:
    """Raise ``KVLayoutError`` unless ``chunks`` hold ``len(hashes)`` blocks of this engine's
    dtype and block shape."""
    shape = block_shape(runner)
    for chunk in chunks:
        if chunk.dtype != runner.dtype:
            raise KVLayoutError(f"dtype {chunk.dtype} differs from the engine's {runner.dtype}")
        if tuple(chunk.shape[1:]) != shape:
            raise KVLayoutError(f"block shape {tuple(chunk.shape[1:])} differs from {shape}")
    if sum(c.shape[0] for c in chunks) != len(hashes):
        raise KVLayoutError(f"{len(hashes)} hashes name {sum(c.shape[0] for c in chunks)} blocks")


def import_blocks(
    kv: KVCacheManager,
    runner: ModelRunner,
    hashes: list[BlockHash],
    chunks: torch.Tensor | list[torch.Tensor],
) -> tuple[int, int]:
    """Install blocks computed elsewhere as free cached blocks, so the next admission hits them.

    ``hashes[i]`` names block ``i`` of the concatenated ``chunks``. The layout is checked first
    (``KVLayoutError``, nothing allocated). Blocks already cached here are skipped; nothing is
    installed if the pool cannot spare the blocks without dipping into the watermark. Returns how
    many leading hashes are now cached here (installed or already present) and how many of those
    this call installed."""
    chunks = [chunks] if isinstance(chunks, torch.Tensor) else chunks
    check_layout(runner, hashes, chunks)
    pool = kv.pool
    present = {i: pool.get_cached_block(h) for i, h in enumerate(hashes)}
    held = {i: b for i, b in present.items() if b is not None}
    missing = [i for i, b in present.items() if b is None]
    if not missing:
        return len(hashes), 0
    # Pinned while the missing blocks are allocated: allocation evicts from the head of the free
    # queue, which may be this very run's cached blocks.
    pool.touch(held.values())
    if len(missing) > pool.num_free_blocks - kv.watermark_blocks:
        pool.free(held[i] for i in sorted(held, reverse=True))
        return missing[0], 0
    blocks = pool.allocate(len(missing))
    by_index = dict(zip(missing, blocks, strict=True))
    start = 0
    for chunk in chunks:
        rows = [i - start for i in missing if start <= i < start + chunk.shape[0]]
        if rows:
            index = torch.tensor(rows, dtype=torch.int64)
            data = chunk.index_select(0, index).permute(1, 2, 0, 3, 4, 5)
            runner.write_blocks([by_index[start + r].block_id for r in rows], data)
        start += chunk.shape[0]
    for i, block in by_index.items():
        pool.cache_block(block, hashes[i])
    # Free in reverse so that the head of the run is evicted last.
    run = {**held, **by_index}
    pool.free(run[i] for i in sorted(run, reverse=True))
    return len(hashes), len(missing)
