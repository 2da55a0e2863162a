"""The KV connector: the one seam through which an external KV store reaches the engine.

In the spirit of vLLM's KV connector API, reduced to what a CPU engine that loads whole prefix
blocks between steps needs. The engine drives it; the connector never touches the block pool or
the model runner:

* ``load``: when a request is added, the engine says how many leading blocks of its prompt are
  cached locally and asks the connector for KV of the blocks after those. The connector hands
  back data it fetched beforehand (asynchronously, off the engine thread) or None.
* The engine checks the data's dtype and block shape against its own KV layout and, when they
  match and the pool can spare the blocks, writes them into blocks it allocates and registers
  them in its prefix cache, so admission hits them. ``loaded`` reports the outcome: how many
  blocks were installed, or why none were (nothing is allocated on a rejection).
* ``on_prompt_computed``: the request's whole prompt is computed and its full blocks are in the
  prefix cache under ``request.block_hashes``; the connector may export them later through
  ``LLMEngine.export_prefix`` (on the engine thread).
* ``on_prefill_chunk``: a step computed a chunk of the request's prompt that is not its last
  (chunked prefill); the blocks its computed tokens fill are in the prefix cache, and the
  connector may export them as above while later chunks compute.

Every method runs on the engine thread, between steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash
from engine.request import Request


@dataclass(frozen=True)
class KVBlocks:
    """KV of a run of blocks: ``hashes[i]`` names block ``i`` of the concatenated ``chunks``,
    each block-major ``[n, layers, 2, block_size, kv_heads, head_dim]``."""

    hashes: list[BlockHash]
    chunks: list[torch.Tensor]


class KVConnector(ABC):
    @abstractmethod
    def load(self, request: Request, num_local_blocks: int) -> KVBlocks | None:
        """KV for the request's blocks from ``num_local_blocks`` on, or None."""

    @abstractmethod
    def loaded(self, request: Request, num_installed: int, rejected: str | None) -> None:
        """The outcome of the last ``load`` for ``request``: blocks installed, or the reason the
        data was refused (``rejected``), in which case the request recomputes them."""

    def on_prefill_chunk(self, request: Request) -> None:
        """A chunk of the request's prompt, not the last, is computed: its first
        ``request.num_computed_tokens // block_size`` blocks are cached here. Optional."""
        return None

    @abstractmethod
    def on_prompt_computed(self, request: Request) -> None:
        """The request's prompt is computed and cached here (``request.num_cached_tokens`` of it
        was a prefix hit)."""
