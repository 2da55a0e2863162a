"""Moving prefix KV blocks in and out of an engine, keyed by block hash.

Both functions must run on the engine's own thread (between steps), where the block pool is
consistent. The exchanged layout is block-major, ``[n, layers, 2, block_size, kv_heads, head_dim]``,
so each block is one contiguous slice and a run can be split or joined without copying.
"""

from __future__ import annotations

import torch

from engine.block_hash import BlockHash
from engine.llm_engine import LLMEngine


def export_blocks(
    engine: LLMEngine, hashes: list[BlockHash]
) -> tuple[list[BlockHash], torch.Tensor]:
    """The KV of the longest leading run of ``hashes`` still cached here (a CPU copy)."""
    pool = engine.kv.pool
    found: list[BlockHash] = []
    ids: list[int] = []
    for h in hashes:
        block = pool.get_cached_block(h)
        if block is None:
            break
        found.append(h)
        ids.append(block.block_id)
    if not ids:
        return [], torch.empty(0)
    kv = engine.runner.read_blocks(ids)  # [layers, 2, n, bs, heads, dim]
    return found, kv.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def import_blocks(engine: LLMEngine, hashes: list[BlockHash], kv: torch.Tensor) -> tuple[int, int]:
    """Install blocks computed elsewhere as free cached blocks, so the next admission hits them.

    ``hashes[i]`` names ``kv[i]``. Blocks already cached here are skipped; nothing is installed
    if the pool cannot spare the blocks without dipping into the watermark. Returns how many
    leading hashes are now cached here (installed or already present) and how many of those
    this call installed."""
    pool = engine.kv.pool
    missing = [i for i, h in enumerate(hashes) if pool.get_cached_block(h) is None]
    if not missing:
        return len(hashes), 0
    if len(missing) > pool.num_free_blocks - engine.kv.watermark_blocks:
        return missing[0], 0
    blocks = pool.allocate(len(missing))
    index = torch.tensor(missing, dtype=torch.int64)
    data = kv.index_select(0, index).permute(1, 2, 0, 3, 4, 5)  # [layers, 2, n, bs, heads, dim]
    engine.runner.write_blocks([b.block_id for b in blocks], data)
    for i, block in zip(missing, blocks, strict=True):
        pool.cache_block(block, hashes[i])
    # Free in reverse so that the head of the run is evicted last.
    pool.free(reversed(blocks))
    return len(hashes), len(missing)
