"""An engine replica's reports to the replica registry, and the registry's view of every replica.

Every ``REPORT_PERIOD_S`` the replica sends the registry its health (its engine loop alive and not
stalled) and a metrics snapshot. The loop starts lazily from the replica's event loop (a Serve
constructor has none) and again if it ever ends. Calls to the registry always run outside the
calling request's context (``detached``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import ray
from ray import serve

from deployments.metrics import ReplicaMetrics
from deployments.stats_log import EngineStatsLog
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

REGISTRY_ACTOR = "registry"
REPORT_PERIOD_S = 1.0


def detached(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``coro`` as a task outside the calling request's context.

    In an async actor, Ray attributes every actor call to the request in whose context it is
    made (a context variable), and cancelling that request (the client went away) cancels those
    calls too. An actor call cancelled before it was sent leaves a gap in the target actor's
    ordered queue for this process, which then holds every later call from here for 30 s: the
    KV directory and the registry would stall. Background loops and calls to those actors
    therefore run in a fresh context; a caller that stops waiting merely stops waiting."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def call(remote_call: Callable[[], Any]) -> Any:
    """Make and await an actor call (inside the coroutine, so in its task's context)."""
    return await remote_call()


class ReplicaReporter:
    """Reports one engine replica to the registry actor (``REGISTRY_ACTOR``).

    ``heartbeat``, when given, is awaited after each report (the KV directory's liveness
    heartbeat rides on the same period)."""

    def __init__(
        self,
        replica_id: str,
        started_at: float,
        engine: LLMEngine,
        async_engine: AsyncEngine,
        metrics: ReplicaMetrics,
        heartbeat: Callable[[], Awaitable[Any]] | None = None,
        stats_log: EngineStatsLog | None = None,
        registry: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.started_at = started_at
        self.engine = engine
        self.async_engine = async_engine
        self.metrics = metrics
        self.heartbeat = heartbeat
        self.stats_log = stats_log
        self._registry: Any = None
        # Resolves the registry actor; None: this replica's own deployment's.
        self._resolve_registry = registry
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        """Start the report loop if it is not running (call from the replica's event loop)."""
        if self._task is None or self._task.done():
            self._task = detached(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.report_once()
            except Exception:  # noqa: BLE001 - reporting must never take the replica down
                logger.warning("replica report failed", exc_info=True)
                self._registry = None
            await asyncio.sleep(REPORT_PERIOD_S)

    async def report_once(self) -> None:
        self.metrics.update(self.engine.stats)
        if self.stats_log is not None:
            self.stats_log.maybe_log(self.engine.stats)
        if self._registry is None:
            self._registry = (
                serve.get_deployment_actor(REGISTRY_ACTOR)
                if self._resolve_registry is None
                else await self._resolve_registry()
            )
        report = {
            "healthy": self.async_engine.is_ready,
            "node_id": ray.get_runtime_context().get_node_id(),
            "started_at": self.started_at,
            "metrics": self.metrics.snapshot(),
            "model": self.engine.model_info(),
        }
        await self._registry.report.remote(self.replica_id, report)
        if self.heartbeat is not None:
            await self.heartbeat()

    async def cluster_report(self) -> dict[str, dict[str, Any]]:
        """Every live replica's latest report, this replica's made just now."""
        self.ensure_started()
        await detached(self.report_once())
        return await detached(call(lambda: self._registry.live.remote()))
