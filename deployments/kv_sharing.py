"""A replica's side of KV sharing: publish computed prefixes, import missing ones.

Publishing: when a request's prompt is fully computed, the hashes of the full prompt blocks it
computed itself (not those it hit) are queued. A background task exports their KV between engine
steps, turns it into a numpy array (zero-copy reads for every importer), puts it in the object
store from a worker thread and registers it in the directory. The engine step never waits on it.

Importing: before a request is queued, the replica checks how much of its prefix is cached
locally; if the directory holds a longer run, it fetches those objects (asynchronously, with a
timeout) and installs them into the block pool just before the request is added, so admission
hits them. Any failure (owner died, object lost, timeout) only means the prefix is recomputed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from deployments.config import KVSharingArgs
from engine.async_engine import AsyncEngine
from engine.kv_transfer import export_blocks, import_blocks
from engine.llm_engine import LLMEngine
from engine.request import Request

logger = logging.getLogger("ray.serve")

_NUMPY_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.float16,
    torch.float32: torch.float32,
}


def to_numpy(kv: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: ship its bits as int16."""
    return kv.contiguous().view(_NUMPY_VIEW[kv.dtype]).numpy()


def from_numpy(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.view(dtype) if dtype == torch.bfloat16 else t


def _export_numpy(engine: LLMEngine, hashes: list[int]) -> tuple[list[int], np.ndarray]:
    found, kv = export_blocks(engine, hashes)
    return found, to_numpy(kv)


@dataclass
class ImportPlan:
    hashes: list[int]
    kv: torch.Tensor


class KVSharing:
    def __init__(
        self,
        replica_id: str,
        async_engine: AsyncEngine,
        args: KVSharingArgs,
        directory: Any,
        metrics: Any,
    ) -> None:
        self.replica_id = replica_id
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.args = args
        self.directory = directory
        self.block_size = self.engine.block_size
        self.dtype = self.engine.dtype
        self._pending: collections.deque[list[int]] = collections.deque(maxlen=1024)
        self._pending_lock = threading.Lock()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.published = metrics.counter(
            "prefixserve_kv_blocks_published", "KV blocks published to the object store."
        )
        self.imported = metrics.counter(
            "prefixserve_kv_blocks_imported", "KV blocks imported from other replicas."
        )
        self.import_failures = metrics.counter(
            "prefixserve_kv_import_failures", "Imports that fell back to recompute."
        )
        self.replica_label = replica_id
        self.engine.on_prefill_done = self._on_prefill_done

    # -- publishing ------------------------------------------------------------------------------
    def _on_prefill_done(self, request: Request) -> None:
        """Engine thread: queue the prompt blocks this replica computed itself."""
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
                    await self._publish(hashes)
                except Exception:  # noqa: BLE001 - publishing is best effort
                    logger.warning("KV publish failed", exc_info=True)
            await asyncio.sleep(0.05)

    async def _publish(self, hashes: list[int]) -> None:
        known = await self.directory.contains.remote(hashes)
        todo = hashes[known:]
        if len(todo) < self.args.min_blocks:
            return
        # Tensor work stays on the engine thread (engine.async_engine: OpenMP teams).
        found, arr = await self.async_engine.call(lambda e: _export_numpy(e, todo))
        if len(found) < self.args.min_blocks:
            return
        ref = await asyncio.to_thread(ray.put, arr)
        block_nbytes = arr.nbytes // len(found)
        added = await self.directory.publish.remote(self.replica_id, found, [ref], block_nbytes)
        self.published.labels(replica=self.replica_label).inc(added)

    # -- importing -------------------------------------------------------------------------------
    def _local_prefix_blocks(self, hashes: list[int]) -> int:
        # A racy read of the engine's cache map, only used as a hint: import_blocks re-checks on
        # the engine thread.
        cached = self.engine.kv.pool.cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    async def plan_import(self, prompt_len: int, hashes: list[int]) -> ImportPlan | None:
        """Fetch the directory's blocks that extend the local prefix hit, or None."""
        usable = hashes[: (prompt_len - 1) // self.block_size]
        local = self._local_prefix_blocks(usable)
        wanted = usable[local:]
        if len(wanted) < self.args.min_blocks:
            return None
        timeout = self.args.fetch_timeout_s
        try:
            entries = await asyncio.wait_for(self.directory.lookup.remote(wanted), timeout)
        except Exception:  # noqa: BLE001 - no directory, no import
            return None
        if len(entries) < self.args.min_blocks:
            return None
        refs: dict[Any, Any] = {}
        for _, ref, _, _ in entries:
            refs.setdefault(ref[0], ref[0])
        try:
            arrays = await asyncio.wait_for(asyncio.gather(*refs.values()), timeout)
        except Exception as e:  # noqa: BLE001 - owner died, object lost, timeout
            self.import_failures.labels(replica=self.replica_label).inc()
            owners = {owner for _, _, _, owner in entries}
            logger.info("KV import failed (%s); recomputing; dropping %s", type(e).__name__, owners)
            for owner in owners:
                if owner != self.replica_id:
                    self.directory.forget_owner.remote(owner)
            return None
        by_ref = dict(zip(refs.keys(), arrays, strict=True))
        # numpy, not torch.stack: parallel tensor work belongs to the engine thread alone.
        kv = from_numpy(
            np.stack([by_ref[ref[0]][index] for _, ref, index, _ in entries]), self.dtype
        )
        return ImportPlan([h for h, _, _, _ in entries], kv)

    def install(self, plan: ImportPlan, request: Request) -> None:
        """Engine thread, just before the request is queued."""
        _, installed = import_blocks(self.engine, plan.hashes, plan.kv)
        request.num_remote_cached_tokens = installed * self.block_size
        if installed:
            self.imported.labels(replica=self.replica_label).inc(installed)
