"""A replica's side of KV sharing through Ray's object store: the engine's KV connector.

Publishing (``deployments.kv_publish``): a request's computed prompt blocks are put in the
object store and registered in the directory from a background task, off the engine step; a
handed-off prompt's as its prefill chunks compute them, the rest before its first token goes out.

Importing: before a request is handed to the engine, ``prefetch`` looks up the blocks after the
local prefix hit in the directory and fetches them, off the engine thread. Fetches are
single-flight: requests whose missing blocks start at the same block share one fetch (and one
copy of its bytes), and the bytes held by fetches at once are bounded (``max_import_bytes``;
past it a request recomputes). Entries whose layout differs from this engine's are never
fetched; the engine checks the data's dtype and shape again before it allocates anything
(``engine.kv_transfer.check_layout``). The engine then takes the fetched blocks through
``load`` when the request is added. Each complete fetch is timed, apart for objects published
on this replica's Ray node and on others (``deployments.import_cost``; the directory records
the publisher's node), for the routers' pricing. Any failure (owner died, object lost, timeout,
directory gone) only means the prefix is recomputed; an object that could not be fetched is
dropped from the directory, and nothing else.

Directory loss: every directory call that fails resets the handle, so the next one resolves the
actor again (Serve recreates a deployment actor that died). The new directory starts empty and
fills as replicas publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray import serve

from deployments.config import KVSharingArgs
from deployments.import_cost import ImportCost
from deployments.kv_directory import BlockLayout, Located
from deployments.kv_publish import NUMPY_VIEW, KVPublisher, layout_of, to_numpy
from engine.async_engine import AsyncEngine
from engine.block_hash import BlockHash
from engine.kv_connector import KVBlocks, KVConnector
from engine.request import Request

logger = logging.getLogger("ray.serve")

# How long a finished fetch stays shareable: requests that looked up the directory while it ran
# are added to the engine (and install its blocks) within about a step of it ending.
FETCH_KEEP_S = 2.0

_TORCH_DTYPES = {str(t).removeprefix("torch."): t for t in NUMPY_VIEW}
__all__ = ["HeldDirectory", "KVSharing", "from_numpy", "layout_of", "to_numpy"]


def from_numpy(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``arr``'s memory (no copy; arrays from the object store are read-only, and
    the importer only reads them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.view(dtype) if dtype == torch.bfloat16 else t


class HeldDirectory:
    """A directory actor's handle held by whoever created the actor (tests, benchmarks): it never
    needs resolving again, so ``reset`` does nothing. Replicas hold a resolving one instead."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, method: str) -> Any:
        return getattr(self.actor, method)

    def reset(self) -> None:
        pass

    async def resolve(self) -> None:
        pass


@dataclass
class Fetched:
    """Blocks fetched for prompts whose missing blocks start at block ``start``: ``hashes``
    name the blocks of the concatenated ``chunks`` (read-only numpy views into the object
    store), in the layout ``layout``."""

    start: int
    hashes: list[BlockHash]
    chunks: list[np.ndarray]
    layout: BlockLayout
    nbytes: int


class KVSharing(KVConnector):
    def __init__(
        self,
        replica_id: str,
        async_engine: AsyncEngine,
        args: KVSharingArgs,
        directory: Any,
        metrics: Any,
        node_id: str | None = None,
    ) -> None:
        """``node_id``: the Ray node this replica runs on (default: the current process's)."""
        self.replica_id = replica_id
        if node_id is None and ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
        self.node_id = node_id
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.args = args
        self.directory = directory
        self.block_size = self.engine.block_size
        self.layout = layout_of(self.engine)
        # Fetches in flight or recently done, by the first block they import.
        self._fetches: dict[BlockHash, asyncio.Task[Fetched | None]] = {}
        self.fetch_bytes = 0
        # Seconds per block of recent fetches, from this node's object store and from others'.
        self.import_cost = ImportCost(node_id)

        def counter(name: str, doc: str) -> Any:
            return metrics.counter(name, doc).labels(replica=replica_id)

        published = counter(
            "prefixserve_kv_blocks_published", "KV blocks published to the object store."
        )
        self.publisher = KVPublisher(
            replica_id, async_engine, args, self.call_directory, published, node_id
        )
        self.imported = counter(
            "prefixserve_kv_blocks_imported", "KV blocks imported from other replicas."
        )
        self.fetches = counter(
            "prefixserve_kv_fetches", "Fetches of published KV runs from the object store."
        )
        self.import_failures = counter(
            "prefixserve_kv_import_failures",
            "Imports that fell back to recompute: lookup or fetch failed or timed out.",
        )
        self.rejected = counter(
            "prefixserve_kv_import_rejected",
            "Published KV refused because its dtype or block shape differs from this engine's.",
        )
        self.skipped = counter(
            "prefixserve_kv_import_skipped",
            "Imports skipped (recomputed) because max_import_bytes were already being fetched.",
        )
        self.engine.kv_connector = self

    async def call_directory(self, method: Callable[[Any], Awaitable[Any]]) -> Any:
        """A directory call; a failure resets the handle (the actor may have been recreated)."""
        try:
            await self.directory.resolve()
            return await method(self.directory)
        except Exception:
            self.directory.reset()
            raise

    async def heartbeat(self) -> None:
        await self.call_directory(lambda d: d.heartbeat.remote(self.replica_id))

    # -- publishing (deployments.kv_publish) -------------------------------------------------------
    def on_prompt_computed(self, request: Request) -> None:
        self.publisher.on_prompt_computed(request)

    def on_prefill_chunk(self, request: Request) -> None:
        self.publisher.on_prefill_chunk(request)

    def start(self) -> None:
        self.publisher.start()

    # -- importing -------------------------------------------------------------------------------
    async def prefetch(self, prompt_len: int, hashes: list[BlockHash]) -> Fetched | None:
        """Fetch the directory's blocks that extend the local prefix hit of a prompt of
        ``prompt_len`` tokens with block ``hashes`` (this engine's), or None. Pass the result
        to the engine with the request (``Request.kv_transfer``)."""
        usable = hashes[: (prompt_len - 1) // self.block_size]
        local = self.engine.num_cached_prefix_blocks(usable)
        wanted = usable[local:]
        if len(wanted) < self.args.min_blocks:
            return None
        key = wanted[0]
        task = self._fetches.get(key)
        if task is None:
            loop = asyncio.get_running_loop()
            # Outside the request's context: its cancellation must not cancel a shared fetch
            # (deployments.replica_report.detached says why).
            task = loop.create_task(self._fetch(local, wanted), context=contextvars.Context())
            self._fetches[key] = task
            task.add_done_callback(
                lambda t: loop.call_later(FETCH_KEEP_S, self._forget_fetch, key, t)
            )
        return await asyncio.shield(task)

    def _forget_fetch(self, key: BlockHash, task: asyncio.Task[Fetched | None]) -> None:
        if self._fetches.get(key) is task:
            del self._fetches[key]
        if not task.cancelled() and task.exception() is None and (fetched := task.result()):
            self.fetch_bytes -= fetched.nbytes

    async def _fetch(self, start: int, wanted: list[BlockHash]) -> Fetched | None:
        timeout = self.args.fetch_timeout_s
        try:
            found: list[Located] = await asyncio.wait_for(
                self.call_directory(lambda d: d.lookup.remote(wanted)), timeout
            )
        except Exception as e:  # noqa: BLE001 - no directory, no import
            logger.info("KV directory lookup failed (%r); recomputing", e)
            self.import_failures.inc()
            return None
        run: list[Located] = []
        for loc in found:
            if loc.layout != self.layout:
                self.rejected.inc()
                break
            run.append(loc)
        if len(run) < self.args.min_blocks:
            return None
        nbytes = sum(loc.block_nbytes for loc in run)
        if self.fetch_bytes + nbytes > self.args.max_import_bytes:
            self.skipped.inc()
            return None
        fetched = await self._fetch_objects(start, run)
        if fetched is not None:
            self.fetch_bytes += fetched.nbytes
        return fetched

    async def _fetch_objects(self, start: int, run: list[Located]) -> Fetched | None:
        """Fetch the objects holding ``run``; the leading blocks whose objects arrived."""
        refs: dict[int, Any] = {}
        for loc in run:
            refs.setdefault(loc.object_id, loc.ref[0])
        self.fetches.inc()
        started = time.perf_counter()
        tasks = {oid: asyncio.ensure_future(_await(ref)) for oid, ref in refs.items()}
        _, pending = await asyncio.wait(tasks.values(), timeout=self.args.fetch_timeout_s)
        if not pending:
            self.import_cost.observe(
                time.perf_counter() - started, len(run), (loc.node_id for loc in run)
            )
        for t in pending:
            t.cancel()
        lost = [oid for oid, t in tasks.items() if t.done() and not t.cancelled() and t.exception()]
        if lost or pending:
            self.import_failures.inc()
            logger.info(
                "KV fetch: %d objects lost, %d timed out; recomputing", len(lost), len(pending)
            )
        if lost:
            # Only what failed: the owner may well be alive (the directory's heartbeats decide).
            with contextlib.suppress(Exception):
                await self.call_directory(lambda d: d.drop_objects.remote(lost))
        hashes: list[BlockHash] = []
        chunks: list[np.ndarray] = []
        i = 0
        while i < len(run):
            oid = run[i].object_id
            t = tasks[oid]
            if not t.done() or t.cancelled() or t.exception() is not None:
                break
            j = i
            while (
                j + 1 < len(run)
                and run[j + 1].object_id == oid
                and run[j + 1].index == run[j].index + 1
            ):
                j += 1
            chunks.append(t.result()[run[i].index : run[j].index + 1])
            hashes.extend(loc.block_hash for loc in run[i : j + 1])
            i = j + 1
        if len(hashes) < self.args.min_blocks:
            return None
        nbytes = sum(c.nbytes for c in chunks)
        return Fetched(start, hashes, chunks, self.layout, nbytes)

    def transfer_cost_ratios(self) -> tuple[float | None, float | None]:
        """Seconds to import a block over seconds to prefill one, both as measured here, for
        blocks published on this node and on another (each None until measured): what the
        router prices a directory hit at."""
        prefill = self.engine.stats.prefill_s_per_token
        return self.import_cost.ratios(prefill * self.block_size if prefill else None)

    def load(self, request: Request, num_local_blocks: int) -> KVBlocks | None:
        """Engine thread: the request's fetched blocks after its ``num_local_blocks``."""
        fetched: Fetched | None = request.kv_transfer
        request.kv_transfer = None
        if fetched is None or num_local_blocks < fetched.start:
            return None  # blocks before the fetched run were evicted meanwhile
        skip = num_local_blocks - fetched.start
        hashes = fetched.hashes[skip:]
        own = request.block_hashes[num_local_blocks : num_local_blocks + len(hashes)]
        n = next((i for i, (a, b) in enumerate(zip(hashes, own, strict=False)) if a != b), len(own))
        if n == 0:
            return None
        dtype = _TORCH_DTYPES.get(fetched.layout.dtype)
        if dtype is None:
            self.rejected.inc()
            return None
        chunks: list[torch.Tensor] = []
        offset = 0
        for arr in fetched.chunks:
            lo, hi = max(skip - offset, 0), min(skip + n - offset, arr.shape[0])
            if lo < hi:
                chunks.append(from_numpy(arr[lo:hi], dtype))
            offset += arr.shape[0]
        return KVBlocks(hashes[:n], chunks)

    def loaded(self, request: Request, num_installed: int, rejected: str | None) -> None:
        if rejected is not None:
            self.rejected.inc()
        elif num_installed:
            self.imported.inc(num_installed)


async def _await(ref: Any) -> Any:
    return await ref


class DeploymentActor:
    """A deployment-scoped actor handle, resolved on first use and again after a failure (Serve
    may recreate the actor). ``source``, when given, resolves it instead of the calling
    replica's own deployment (a Prefill replica uses the Engine deployment's actors); callers
    then ``await resolve()`` before each use."""

    def __init__(self, name: str, source: Callable[[str], Awaitable[Any]] | None = None) -> None:
        self.name = name
        self.source = source
        self._handle: Any = None

    async def resolve(self) -> None:
        if self._handle is None and self.source is not None:
            self._handle = await self.source(self.name)

    def __getattr__(self, method: str) -> Any:
        if self._handle is None:
            self._handle = serve.get_deployment_actor(self.name)
        return getattr(self._handle, method)

    def reset(self) -> None:
        self._handle = None
