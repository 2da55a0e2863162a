"""The direct layout: the engine replica serves the OpenAI routes itself.

A streamed token crosses no process boundary between the engine thread and the HTTP response:
the engine thread hands deltas to this replica's event loop, which writes SSE to the socket of
the replica's own HTTP server (Serve's direct ingress, HAProxy in front, where enabled) or to
Serve's proxy (one hop) otherwise. Requests are validated and tokenized here once; there is no
second replica to retry on, so an engine failure is answered as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from deployments.engine_replica import EngineReplica
from deployments.engine_request import EngineRequest
from deployments.frontend import OpenAIFrontend, openai_routes

logger = logging.getLogger("ray.serve")


class LocalStream:
    """An engine request's items from ``EngineReplica.generate`` in this process."""

    def __init__(self, items: AsyncIterator[dict[str, Any]]) -> None:
        self.items = items
        self._closing: asyncio.Task[None] | None = None

    def __anext__(self) -> Any:
        return self.items.__anext__()

    def cancel(self) -> None:
        """Close the generator, which aborts the engine request and frees its blocks. Called
        once nobody awaits the next item (the response ended or failed)."""
        if self._closing is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Collected outside the loop (the lease's last resort): the generator's own
            # finalizer closes it.
            return
        self._closing = loop.create_task(self._close())

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.items.aclose()  # type: ignore[attr-defined]


class LocalBackend:
    max_attempts = 1

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica

    def open(
        self, req: EngineRequest, index: int, num_prompts: int, key: str | None = None
    ) -> LocalStream:
        return LocalStream(self.replica.generate(req))

    async def kv_namespace(self) -> str | None:
        return self.replica.kv_namespace()


app, OpenAIRoutes = openai_routes()


class EngineServer(OpenAIRoutes, EngineReplica):  # type: ignore[misc, valid-type]
    """An engine replica with the HTTP routes (``deployments.app`` applies ``serve.ingress``
    and ``serve.deployment``)."""

    def __init__(self, args: dict[str, Any]) -> None:
        EngineReplica.__init__(self, args)
        self.frontend = OpenAIFrontend(
            self.args, LocalBackend(self), self.replica_id, reports=self.cluster_report
        )
