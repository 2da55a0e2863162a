"""Running a validated request on the engine and shaping its stream into the HTTP response.

One engine request per prompt, each opened on an ``EngineBackend`` (a replica chosen by the
request router through a handle, or the engine in this very process), their items merged into
one response: JSON when the client waits for the whole answer, SSE otherwise.

Failures: a prompt whose engine attempt fails before anything reached the client (the replica
died, refused with 429, or its engine had died before the request got there) is tried again, up
to the backend's ``max_attempts`` (another replica may succeed; a local backend has one). A
non-streamed request is retried even after tokens were produced, since none were sent. A stream
that already started is resumed on another replica from the tokens already sent, where the
backend has other replicas and the request's sampling allows it
(``deployments.stream_resumer``), at most ``failover.MAX_RESUMES`` times; otherwise it ends with
an SSE error event. A request that was running when its engine loop died is not retried (it may
be what broke it): it gets a 503.

Under prefill/decode disaggregation an eligible prompt's first token comes from the Prefill
deployment and the rest from the Engine deployment, as a planned resumption
(``deployments.disaggregation``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from deployments import request_logging, tracing
from deployments.admission import Admission, Lease, LeasedStreamingResponse, gather, read_to_end
from deployments.choices import merge_streams
from deployments.config import AppArgs
from deployments.disaggregation import HandoffMetrics, PrefillFirst
from deployments.engine_backend import EngineBackend, RetryableError, prompt_text
from deployments.engine_request import (
    DEADLINE_EXCEEDED,
    EngineError,
    EngineRequest,
    StreamItem,
)
from deployments.failover import PromptProgress
from deployments.http_errors import HTTPError
from deployments.kv_namespace import prompt_block_hashes
from deployments.openai_format import ResponseBuilder, error_body, sse
from deployments.stream_resumer import StreamResumer
from deployments.validation import GenerationJob
from engine.block_hash import hash_key

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

RETRY_BACKOFF_S = 0.1


class Generation:
    """Runs ``GenerationJob``s on one backend; one per HTTP-serving replica."""

    def __init__(
        self,
        args: AppArgs,
        backend: EngineBackend,
        admission: Admission,
        prefill: EngineBackend | None = None,
    ) -> None:
        """``prefill``: the Prefill deployment, under prefill/decode disaggregation (``backend``
        is then the decode side)."""
        self.args = args
        self.backend = backend
        self.admission = admission
        self.block_size = args.engine.block_size
        self.prefill_first = (
            None
            if prefill is None
            else PrefillFirst(
                prefill,
                backend,
                HandoffMetrics(admission.metrics.registry, admission.metrics.ingress_id),
                self.block_size,
                args.kv_sharing.min_blocks,
                args.disaggregation.tbt_slo_ms,
            )
        )
        self.hash_key = hash_key(args.kv_hash_key)
        self.resumer = StreamResumer(backend, admission, self._next_item, self._hasher)
        self.retry_after = {"Retry-After": str(args.limits.retry_after_s)}
        self.traced = tracing.enabled(args.otlp_traces_endpoint)
        # Ray's prefix router reads the prompt's text; our policies never need it.
        self.carry_text = args.routing_policy == "ray_prefix_affinity"

    def _replica_header(self, items: list[StreamItem]) -> dict[str, str]:
        """Which engine replica served the request (several, comma-separated, for several
        prompts); none when the deployment does not report cache hits (a replica's name tells
        which cache a prompt went to)."""
        if not self.args.report_cache_hits:
            return {}
        return {"x-engine-replica": ",".join(dict.fromkeys(i.replica_id for i in items))}

    def overloaded(self, what: str, queue: str) -> HTTPError:
        self.admission.metrics.rejected[queue].inc()
        return HTTPError(
            429,
            f"server overloaded: {what}; retry later",
            "overloaded_error",
            code="overloaded",
            headers=self.retry_after,
        )

    def check_capacity(self, sequences: int = 1) -> None:
        """Refuse when ``sequences`` more would not fit: cheaply before the body is read (one),
        then with the request's own count. A request larger than the limit never reaches here
        (``RequestValidator`` answers 400)."""
        if not self.admission.has_room(sequences):
            raise self.overloaded(
                f"{self.admission.inflight} sequences in flight, {sequences} more asked "
                f"(limit {self.admission.limit})",
                "ingress",
            )

    def engine_requests(self, job: GenerationJob, namespace: str | None) -> list[EngineRequest]:
        rid = job.builder.id
        # The HTTP span's context (current while the route runs), for the spans downstream.
        carrier = tracing.current_carrier() if self.traced else None
        return [
            EngineRequest(
                request_id=rid if len(job.prompts) == 1 else f"{rid}-{i}",
                prompt_token_ids=ids,
                sampling=job.params,
                block_hashes=prompt_block_hashes(
                    ids, self.block_size, namespace, self.hash_key, job.cache_salt
                ),
                kv_namespace=namespace,
                priority=job.priority,
                deadline_ms=job.deadline_ms,
                timeout_s=self.args.limits.request_timeout_s,
                stream=job.stream,
                n=job.n,
                cache_salt=job.cache_salt,
                x_request_id=request_logging.current().x_request_id,
                trace_context=carrier,
                session_id=job.session_id,
                group_id=rid,
                prompt=prompt_text(job.builder.tokenizer, ids) if self.carry_text else None,
            )
            for i, ids in enumerate(job.prompts)
        ]

    async def run(self, job: GenerationJob) -> Response:
        namespace = await self.backend.kv_namespace()
        # Again, now for every sequence: the body was read since, other requests came in.
        self.check_capacity(job.num_sequences)
        engine_reqs = self.engine_requests(job, namespace)
        # No await between the check above and this count: admission is atomic.
        lease = self.admission.lease(len(engine_reqs), job.num_sequences)
        handed_off = False
        try:
            if job.stream:
                tokenizer = job.builder.tokenizer
                firsts = await gather(
                    [self._open(lease, i, r, job.n, tokenizer) for i, r in enumerate(engine_reqs)]
                )
                handed_off = True
                return LeasedStreamingResponse(
                    self._sse(lease, engine_reqs, firsts, job.builder, job.include_usage),
                    lease,
                    media_type="text/event-stream",
                    headers=self._replica_header(firsts),
                )
            results = await gather(
                [
                    self._complete(lease, i, r, job.n, job.builder.tokenizer)
                    for i, r in enumerate(engine_reqs)
                ]
            )
            items = [item for its in results for item in its]
            return JSONResponse(job.builder.full(items), headers=self._replica_header(items))
        finally:
            if not handed_off:
                lease.release()

    async def _retry_pause(self, e: RetryableError, attempt: int) -> None:
        """Before attempt ``attempt + 1``; raises the error once the attempts are used up."""
        logger.warning("engine attempt %d failed: %s", attempt, e)
        if attempt >= self.backend.max_attempts:
            raise e.error from e
        self.admission.metrics.retries.inc()
        if e.backoff:
            await asyncio.sleep(RETRY_BACKOFF_S * attempt)

    async def _attempt(
        self,
        lease: Lease,
        i: int,
        engine_req: EngineRequest,
        n: int,
        read: Callable[[Any, int], Awaitable[T]],
        backend: EngineBackend | None = None,
    ) -> T:
        """``read(stream, index offset)`` on prompt ``i``'s stream, again while it fails in a
        way another attempt may not. Each attempt after the first has a request id of its own
        (``<id>-retry<k>``): the replica that failed it may still hold the first. ``backend``:
        where it runs (default: the Engine deployment's)."""
        attempt = 1
        req = engine_req
        backend = backend or self.backend
        while True:
            stream = lease.streams[i] = backend.open(req, i, len(lease.streams))
            try:
                return await read(stream, i * n)
            except RetryableError as e:
                stream.cancel()
                await self._retry_pause(e, attempt)
                attempt += 1
                req = replace(engine_req, request_id=f"{engine_req.request_id}-retry{attempt - 1}")

    async def _open(
        self, lease: Lease, i: int, engine_req: EngineRequest, n: int, tokenizer: Any = None
    ) -> StreamItem:
        """Start prompt ``i``'s stream: its first item."""
        if self._disaggregated(engine_req):
            return await self._prefill_then_decode(lease, i, engine_req, n, tokenizer)
        return await self._attempt(lease, i, engine_req, n, self._next_item)

    async def _complete(
        self, lease: Lease, i: int, engine_req: EngineRequest, n: int, tokenizer: Any = None
    ) -> list[StreamItem]:
        """Prompt ``i``'s every item; retried as a whole, since nothing was sent yet (a
        handed-off prompt's decode side is resumed instead, as a stream's)."""
        if self._disaggregated(engine_req):
            items = [await self._prefill_then_decode(lease, i, engine_req, n, tokenizer)]
            progress = PromptProgress(engine_req, i * n)
            progress.observe(items[0])
            while not items[-1].done:
                items.append(await self.resumer.next_or_resume(lease, i, progress, tokenizer))
                progress.observe(items[-1])
        else:
            items = await self._attempt(lease, i, engine_req, n, self._collect)
        lease.ended[i] = True
        await read_to_end(lease.streams[i])
        return items

    def _disaggregated(self, req: EngineRequest) -> bool:
        return self.prefill_first is not None and self.prefill_first.applies(req)

    async def _prefill_then_decode(
        self, lease: Lease, i: int, engine_req: EngineRequest, n: int, tokenizer: Any
    ) -> StreamItem:
        """Prompt ``i``'s first item from a Prefill replica, its stream then on the decode side
        (``deployments.disaggregation.PrefillFirst``)."""
        assert self.prefill_first is not None

        def attempt(req: EngineRequest, backend: EngineBackend) -> Awaitable[StreamItem]:
            return self._attempt(lease, i, req, n, self._next_item, backend)

        return await self.prefill_first.open(
            lease, i, n, engine_req, tokenizer, attempt, self._hasher(engine_req)
        )

    async def _collect(self, stream: Any, offset: int) -> list[StreamItem]:
        items = [await self._next_item(stream, offset)]
        while not items[-1].done:
            items.append(await self._next_item(stream, offset))
        return items

    async def _next_item(self, stream: Any, offset: int = 0) -> StreamItem:
        """The stream's next item, its choice index moved up by ``offset`` (the prompt's first
        choice); an engine failure becomes ``HTTPError`` or, when another attempt may succeed,
        ``RetryableError``."""
        try:
            item = await stream.__anext__()
        except StopAsyncIteration as e:
            raise RetryableError(self._unavailable("engine stream ended early")) from e
        except BackPressureError as e:
            raise self.overloaded("engine queue is full", "engine_queue") from e
        except RayActorError as e:
            # The replica died (or is unreachable): Serve routes the retry elsewhere.
            raise RetryableError(self._unavailable(f"engine replica failed: {e!r}")) from e
        except Exception as e:
            logger.warning("engine call failed: %r", e)
            raise self._unavailable(f"engine unavailable: {type(e).__name__}") from e
        if isinstance(item, EngineError):
            if item.retryable:  # never reached a working engine
                raise RetryableError(self._unavailable(item.message))
            if item.status == 429 and item.code != DEADLINE_EXCEEDED:
                # The router's view of replica load lags; another replica may have room (a
                # missed deadline is missed everywhere).
                self.admission.metrics.rejected["engine_replica"].inc()
                raise RetryableError(self._item_error(item), backoff=False)
            raise self._item_error(item)
        item.index += offset
        return item

    def _item_error(self, err: EngineError) -> HTTPError:
        headers = self.retry_after if err.status in (429, 503) else None
        return HTTPError(err.status, err.message, err.type, code=err.code, headers=headers)

    def _unavailable(self, message: str) -> HTTPError:
        return HTTPError(
            503, message, "service_unavailable", code="engine_unavailable", headers=self.retry_after
        )

    def _hasher(self, req: EngineRequest) -> Callable[[list[int]], list[int]]:
        """Block hashes of a prompt as ``req``'s were computed."""
        return lambda ids: prompt_block_hashes(
            ids, self.block_size, req.kv_namespace, self.hash_key, req.cache_salt
        )

    async def _sse(
        self,
        lease: Lease,
        engine_reqs: list[EngineRequest],
        firsts: list[StreamItem],
        builder: ResponseBuilder,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        async def prompt_items(i: int) -> AsyncIterator[StreamItem]:
            progress = PromptProgress(engine_reqs[i], i * builder.n)
            item = firsts[i]
            while True:
                progress.observe(item)
                yield item
                if item.done:
                    lease.ended[i] = True
                    return
                item = await self.resumer.next_or_resume(lease, i, progress, builder.tokenizer)

        try:
            if builder.chat:
                for index in range(builder.num_choices):
                    yield sse(builder.role_chunk(index))
            merged = merge_streams([prompt_items(i) for i in range(len(firsts))])
            try:
                async for _, item in merged:
                    if builder.has_content(item):
                        yield sse(builder.chunk(item))
                if include_usage:
                    yield sse(builder.usage_chunk())
            except (HTTPError, RetryableError) as e:
                # Tokens already went out: the stream ends with an error event.
                err = e.error if isinstance(e, RetryableError) else e
                logger.warning("engine stream failed: %s", err)
                yield sse(error_body(str(err), err.type, err.param, err.code))
            except Exception:  # noqa: BLE001 - a bug here must still end the stream properly
                logger.exception("streaming a response failed")
                yield sse(error_body("internal error", "internal_server_error", None, None))
            finally:
                await merged.aclose()
            yield b"data: [DONE]\n\n"
            for stream, ended in zip(lease.streams, lease.ended, strict=True):
                if ended:
                    await read_to_end(stream)
        finally:
            lease.release()
