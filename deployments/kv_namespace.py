"""The HTTP side's view of the engine replicas' KV namespace.

The ingress (and the direct layout's replica chooser) hash prompts into block hashes for routing,
and those must be the replicas' own hashes. Their namespace (``engine.kv_fingerprint``: the
weights' content, the dtype each replica resolved on its host, the KV layout) is therefore asked
of the replicas, never recomputed here. Combined with the application's hash key it gives the
same roots the engines use (``engine.block_hash.hash_root``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable

from engine.block_hash import BlockHash, compute_block_hashes, hash_root

logger = logging.getLogger("ray.serve")

# How long the first request waits for the first answer before it is routed without hashes.
FIRST_FETCH_WAIT_S = 2.0


class NamespaceSource:
    """The namespace some engine replica last reported, refetched every ``refresh_s`` in the
    background so that a rolling update that changes it (another dtype, other weights) is
    followed. ``get`` waits only for the very first answer, and at most ``FIRST_FETCH_WAIT_S``;
    None means unknown (prompts are then routed by load alone, never by wrong hashes)."""

    def __init__(self, fetch: Callable[[], Awaitable[str]], refresh_s: float = 10.0) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self.namespace: str | None = None
        self._fetched_at = -float("inf")
        self._task: asyncio.Task[None] | None = None

    async def _refresh(self) -> None:
        try:
            self.namespace = await self._fetch()
        except Exception as e:  # noqa: BLE001 - keep the last known value; try again later
            logger.warning("could not read the engine replicas' KV namespace: %r", e)
        finally:
            self._fetched_at = time.monotonic()

    async def get(self) -> str | None:
        stale = time.monotonic() - self._fetched_at > self.refresh_s
        if stale and (self._task is None or self._task.done()):
            # Outside the calling request's context: its cancellation must not cancel the fetch
            # (deployments.replica_report.detached says why).
            self._task = asyncio.get_running_loop().create_task(
                self._refresh(), context=contextvars.Context()
            )
        if self.namespace is None and self._task is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), FIRST_FETCH_WAIT_S)
        return self.namespace


def prompt_block_hashes(
    token_ids: list[int],
    block_size: int,
    namespace: str | None,
    key: bytes,
    cache_salt: str | None,
) -> list[BlockHash]:
    """The prompt's block hashes under ``namespace`` (none when it is unknown)."""
    if namespace is None:
        return []
    return compute_block_hashes(token_ids, block_size, hash_root(namespace, key, cache_salt))
