"""A replica's publishing side of KV sharing: its computed prompt blocks into the KV directory.

Two paths put blocks in the object store and register them in the directory, both through
``KVPublisher.publish``:

* **Background**: when a request's prompt is computed, the hashes of its full prompt blocks are
  queued (``on_prompt_computed``, engine thread). A loop exports the blocks the directory lacks
  between engine steps, at most ``max_blocks_per_object`` per object, turns each run into a
  numpy array (zero-copy reads for every importer), puts it in the object store from a worker
  thread and registers it with its layout. The engine step never waits on it.
* **Handoff** (prefill/decode disaggregation): a prefill replica announces a handed-off request
  before it reaches the engine (``expect_handoff``). Each prefill chunk's newly computed full
  blocks are exported right where the engine reports the chunk (``on_prefill_chunk``, on the
  engine thread between steps: an export queued behind the next chunk would wait for its whole
  step), and put and registered from the event loop while the next chunk computes, one run at
  a time per request; the last chunk's at the first token (``on_prompt_computed``). When the
  prefill ends, ``hand_off`` waits for those runs, publishes whatever the directory still
  lacks and returns how many leading blocks it holds: the replica sends the first token only
  after that, so the decode replica's lookup cannot race the publish.

Publishing is best effort: a failure is logged and leaves blocks to be recomputed by importers.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from deployments.config import KVSharingArgs
from deployments.kv_directory import BlockLayout
from engine.async_engine import AsyncEngine
from engine.block_hash import BlockHash
from engine.llm_engine import LLMEngine
from engine.request import Request

logger = logging.getLogger("ray.serve")

NUMPY_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.float16,
    torch.float32: torch.float32,
}


def to_numpy(kv: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: ship its bits as int16."""
    return kv.contiguous().view(NUMPY_VIEW[kv.dtype]).numpy()


def layout_of(engine: LLMEngine) -> BlockLayout:
    return BlockLayout(str(engine.dtype).removeprefix("torch."), engine.kv_block_shape)


def _export_numpy(engine: LLMEngine, hashes: list[BlockHash]) -> tuple[list[BlockHash], np.ndarray]:
    found, kv = engine.export_prefix(hashes)
    return found, to_numpy(kv)


Run = tuple[list[BlockHash], np.ndarray]


@dataclass
class _Handoff:
    """A handed-off request's chunk-wise publication. ``exported``: the prompt blocks exported
    so far (None: none yet), touched on the engine thread only; ``runs``: exported runs not yet
    stored, in prompt order, and ``task``, storing them, touched on the event loop only."""

    loop: asyncio.AbstractEventLoop
    exported: int | None = None
    runs: collections.deque[Run] = field(default_factory=collections.deque)
    task: asyncio.Task[None] | None = None


class KVPublisher:
    def __init__(
        self,
        replica_id: str,
        async_engine: AsyncEngine,
        args: KVSharingArgs,
        call_directory: Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[Any]],
        published: Any,
        node_id: str | None,
        put: Callable[[np.ndarray], Any] = ray.put,
    ) -> None:
        """``call_directory``: runs a directory call (``KVSharing.call_directory``);
        ``published``: the counter of blocks this replica published; ``put``: stores an array
        in the object store, returning its reference."""
        self.replica_id = replica_id
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.args = args
        self.call_directory = call_directory
        self.published = published
        self.node_id = node_id
        self.put = put
        self.block_size = self.engine.block_size
        self.layout = layout_of(self.engine)
        self.block_nbytes = math.prod(self.layout.block_shape) * self.engine.dtype.itemsize
        self._pending: collections.deque[list[int]] = collections.deque(maxlen=1024)
        self._pending_lock = threading.Lock()
        self._task: asyncio.Task | None = None
        # Handed-off requests announced and not yet handed off, by engine request id.
        self._handoffs: dict[str, _Handoff] = {}

    # -- background ------------------------------------------------------------------------------
    def on_prompt_computed(self, request: Request) -> None:
        """Engine thread: queue the prompt blocks this replica computed itself (a handed-off
        prompt's are exported now)."""
        self._export_computed(request, request.num_prompt_tokens)
        first = max(request.num_cached_tokens, 0) // self.block_size
        last = request.num_prompt_tokens // self.block_size
        if last - first < self.args.min_blocks:
            return
        # The leading hit blocks are kept too: an importer needs the run from block 0, and the
        # directory skips hashes it already has.
        with self._pending_lock:
            self._pending.append(request.block_hashes[:last])

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._publish_loop())

    async def _publish_loop(self) -> None:
        while True:
            with self._pending_lock:
                batch = list(self._pending)
                self._pending.clear()
            for hashes in batch:
                try:
                    await self.publish(hashes)
                except Exception:  # noqa: BLE001 - publishing is best effort
                    logger.warning("KV publish failed", exc_info=True)
            await asyncio.sleep(0.05)

    async def publish(self, hashes: list[BlockHash], min_new: int | None = None) -> None:
        """Publish the run ``hashes`` from where the directory's leading run ends, if at least
        ``min_new`` (default ``min_blocks``) blocks are missing."""
        known = await self.call_directory(lambda d: d.contains.remote(hashes))
        todo = hashes[known:]
        if not todo or len(todo) < (self.args.min_blocks if min_new is None else min_new):
            return
        step = self.args.max_blocks_per_object
        for i in range(0, len(todo), step):
            part = todo[i : i + step]
            # Tensor work stays on the engine thread (engine.async_engine: OpenMP teams).
            found, arr = await self.async_engine.call(lambda e, part=part: _export_numpy(e, part))
            if not found:
                return
            await self._store(found, arr)
            if len(found) < len(part):
                return  # evicted here meanwhile: the rest of the run cannot follow

    async def _store(self, found: list[BlockHash], arr: np.ndarray) -> None:
        """Put the exported run in the object store and register it in the directory."""
        ref = await asyncio.to_thread(self.put, arr)
        block_nbytes = arr.nbytes // len(found)
        added = await self.call_directory(
            lambda d: d.publish.remote(
                self.replica_id, found, [ref], block_nbytes, self.layout, self.node_id
            )
        )
        self.published.inc(added)

    # -- handoff ---------------------------------------------------------------------------------
    def expect_handoff(self, request_id: str) -> None:
        """Event loop, before the request reaches the engine: publish its prompt's blocks as
        its prefill chunks compute them. ``hand_off`` or ``forget_handoff`` ends it."""
        self._handoffs[request_id] = _Handoff(asyncio.get_running_loop())

    def forget_handoff(self, request_id: str) -> None:
        """The request ended without a handoff (failed, aborted): stop following it (a publish
        under way completes; its blocks are merely early)."""
        self._handoffs.pop(request_id, None)

    def on_prefill_chunk(self, request: Request) -> None:
        """Engine thread: a chunk of the request's prefill was computed (not the last one)."""
        self._export_computed(request, request.num_computed_tokens)

    def _export_computed(self, request: Request, num_tokens: int) -> None:
        """Engine thread: export a handed-off request's full blocks within its first
        ``num_tokens`` tokens not exported yet, and queue them for storing."""
        handoff = self._handoffs.get(request.request_id)
        if handoff is None:
            return
        if handoff.exported is None:
            # Its prefix hits are normally published already (hand_off checks).
            handoff.exported = max(request.num_cached_tokens, 0) // self.block_size
        full = min(num_tokens // self.block_size, len(request.block_hashes))
        while handoff.exported < full:
            end = min(full, handoff.exported + self.args.max_blocks_per_object)
            part = request.block_hashes[handoff.exported : end]
            found, arr = _export_numpy(self.engine, part)
            if not found:
                return  # evicted meanwhile: hand_off publishes what it can
            handoff.exported += len(found)
            handoff.loop.call_soon_threadsafe(self._queue_run, handoff, (found, arr))
            if len(found) < len(part):
                return

    def _queue_run(self, handoff: _Handoff, run: Run) -> None:
        handoff.runs.append(run)
        if handoff.task is None or handoff.task.done():
            # Outside any request's context: cancelling the request must not cancel a directory
            # call under way (deployments.replica_report.detached says why).
            handoff.task = handoff.loop.create_task(
                self._store_runs(handoff), context=contextvars.Context()
            )

    async def _store_runs(self, handoff: _Handoff) -> None:
        while handoff.runs:
            found, arr = handoff.runs.popleft()
            try:
                await self._store(found, arr)
            except Exception:  # noqa: BLE001 - hand_off publishes what is still missing
                logger.warning("KV handoff chunk publish failed", exc_info=True)
                handoff.runs.clear()
                return

    async def hand_off(
        self, hashes: list[BlockHash], request_id: str | None = None
    ) -> tuple[int, int]:
        """Publish the prompt blocks ``hashes`` (cached here) that the directory lacks, now
        rather than from the background loop, once request ``request_id``'s exported runs are
        stored; return how many leading blocks of them the directory holds afterwards,
        with their bytes. Best effort: a failure or timeout hands off fewer blocks, which the
        decode replica recomputes."""
        handoff = None if request_id is None else self._handoffs.pop(request_id, None)

        async def publish() -> int:
            while handoff is not None and handoff.task is not None and not handoff.task.done():
                await asyncio.shield(handoff.task)
            # Normally nothing is missing by now: this costs one directory call.
            await self.publish(hashes, min_new=1)
            return await self.call_directory(lambda d: d.contains.remote(hashes))

        try:
            held = await asyncio.wait_for(publish(), self.args.fetch_timeout_s)
        except Exception:  # noqa: BLE001 - the decode side recomputes what is missing
            logger.warning("KV handoff publish failed", exc_info=True)
            return 0, 0
        return held, held * self.block_nbytes
