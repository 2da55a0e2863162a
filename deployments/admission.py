"""Admission on the HTTP side: a request's slot in the in-flight count and its engine streams.

One ``Admission`` per HTTP-serving replica counts the sequences in flight through it (a request
of ``p`` prompts with ``n`` choices is ``p * n`` sequences, each a row of an engine's batch; a
stream counts until it ends) and refuses past ``limits.max_ongoing_per_ingress``. A request
holds a ``Lease`` from admission until its response is complete; releasing it cancels every
engine stream that has not delivered its final item, so the engine aborts those requests and
frees their blocks.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

__all__ = ["CONTENT_TYPE_LATEST"]

# How long the end of an engine stream may lag its final item.
READ_TO_END_TIMEOUT_S = 5.0


REJECT_QUEUES = ("ingress", "engine_queue", "engine_replica")


class IngressMetrics:
    """Admission figures of one ingress replica, appended to ``/metrics``."""

    def __init__(self, ingress_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.ingress_id = ingress_id
        r, labels = self.registry, {"ingress": ingress_id}
        self.in_flight = Gauge(
            "prefixserve_ingress_requests_in_flight",
            "Sequences (prompts x n of each request) in flight through the ingress replica "
            "(streams until they end).",
            ["ingress"],
            registry=r,
        ).labels(**labels)
        self.in_flight_peak = Gauge(
            "prefixserve_ingress_requests_in_flight_peak",
            "Most sequences in flight through the ingress replica at once.",
            ["ingress"],
            registry=r,
        ).labels(**labels)
        rejected = Counter(
            "prefixserve_ingress_requests_rejected",
            "Refusals for overload, by the queue that was full: ingress (this replica's in-flight "
            "limit) and engine_queue (the engine handle's queue) answer 429; engine_replica (an "
            "engine replica at its limit) is retried on another replica first.",
            ["ingress", "queue"],
            registry=r,
        )
        self.rejected = {q: rejected.labels(queue=q, **labels) for q in REJECT_QUEUES}
        self.retries = Counter(
            "prefixserve_ingress_engine_retries",
            "Requests re-sent to another engine replica after one failed before any output.",
            ["ingress"],
            registry=r,
        ).labels(**labels)
        self.failovers = Counter(
            "prefixserve_failovers",
            "Choices of streams resumed on another engine replica after theirs failed mid-stream "
            "(deployments.failover).",
            ["ingress"],
            registry=r,
        ).labels(**labels)
        self.peak = 0
        self.in_flight.set(0)
        self.in_flight_peak.set(0)

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(n)
        if n > self.peak:
            self.peak = n
            self.in_flight_peak.set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Admission:
    """The in-flight sequence count of one HTTP-serving replica and its limit. Checking and
    counting a request happen with no await in between, so admission is atomic on the event
    loop. Invariant: ``inflight`` is the sum of the unreleased leases' ``sequences``."""

    def __init__(self, replica_id: str, limit: int) -> None:
        self.limit = limit
        self.inflight = 0
        self.metrics = IngressMetrics(replica_id)

    def has_room(self, sequences: int) -> bool:
        return self.inflight + sequences <= self.limit

    def lease(self, num_streams: int, sequences: int) -> Lease:
        """Count a request's sequences in; the lease counts them out when released."""
        self._set(self.inflight + sequences)
        return Lease(self, num_streams, sequences)

    def _set(self, n: int) -> None:
        self.inflight = n
        self.metrics.set_in_flight(n)


class Lease:
    """A request's ``sequences`` (prompts x n) in the ingress's in-flight count and its engine
    streams (one per prompt).

    ``release`` is idempotent and runs exactly once in effect: from the route when the response
    is complete, else from the SSE generator's ``finally`` or the streaming response's own
    ``finally`` (which also covers a client gone before the generator started), or at worst when
    the response object is collected. A stream that has not delivered its final item is
    cancelled, so the engine aborts the request and frees its blocks."""

    def __init__(self, admission: Admission, num_streams: int, sequences: int) -> None:
        self.admission = admission
        self.sequences = sequences
        self.streams: list[Any] = [None] * num_streams
        # Stream i delivered its final item: nothing left to abort.
        self.ended = [False] * num_streams
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for stream, ended in zip(self.streams, self.ended, strict=True):
            if stream is not None and not ended:
                stream.cancel()
        self.admission._set(self.admission.inflight - self.sequences)


class LeasedStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], lease: Lease, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.lease = lease
        weakref.finalize(self, lease.release)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                # A client gone mid-send leaves the body generator suspended with its readers
                # of the engine streams (one per prompt) still waiting on them; close it first,
                # so that they stop and the release below can close a local engine stream.
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.lease.release()


async def read_to_end(stream: Any) -> None:
    """Read a finished engine stream past its final item. Serve counts a request against its
    replica until the call completes, and a gRPC call completes only when the caller reads its
    end: without this the router would see every finished request as still running there."""
    try:
        item = await asyncio.wait_for(stream.__anext__(), READ_TO_END_TIMEOUT_S)
    except StopAsyncIteration:
        return
    except Exception as e:  # noqa: BLE001 - the answer is complete; only the call's end is lost
        logger.warning("engine stream did not end cleanly after its final item: %r", e)
    else:
        logger.warning("engine stream went on after its final item: %r", item)
    stream.cancel()


async def gather(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run the coroutines together; the first to fail cancels the rest and its error is raised
    (not wrapped in an exception group)."""
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]
