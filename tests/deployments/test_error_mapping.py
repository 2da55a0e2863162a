"""Without a cluster: how the HTTP side maps every engine-side failure to an HTTP answer, and the
Serve options that bound every queue. Every overload path must be a 429 with Retry-After, every
engine failure a 503 with Retry-After (retried first when nothing reached the client and another
engine replica may serve it: the routed layout's handle, not the direct layout's local engine)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

import deployments.admission as admission_module
import deployments.generation as generation_module
from deployments.admission import Admission, gather, read_to_end
from deployments.app import (
    HEALTH_CHECK_PERIOD_S,
    HEALTH_CHECK_TIMEOUT_S,
    build_app,
    engine_serve_options,
    engine_server_deployment,
    ingress_serve_options,
)
from deployments.config import AppArgs
from deployments.engine_backend import RetryableError
from deployments.engine_request import EngineError, EngineRequest, StreamItem
from deployments.engine_server import LocalBackend, LocalStream
from deployments.frontend import health_verdict
from deployments.generation import Generation
from deployments.http_errors import HTTPError
from deployments.ingress import MAX_ATTEMPTS, HandleBackend, Ingress
from deployments.openai_format import ResponseBuilder
from deployments.validation import GenerationJob
from engine.sampling_params import SamplingParams

# Serve replaces a replica after this many failed health checks in a row.
SERVE_UNHEALTHY_THRESHOLD = 3


class FakeStream:
    """A DeploymentResponseGenerator stand-in: yields items or raises."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.cancelled = 0

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        if not self.outcomes:
            raise StopAsyncIteration
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    def cancel(self) -> None:
        self.cancelled += 1


class HangingStream(FakeStream):
    async def __anext__(self) -> Any:
        await asyncio.sleep(3600)


class FakeBackend:
    """An ``EngineBackend`` with as many attempts as the routed layout's ``HandleBackend``: hands
    out scripted streams, one per ``open``."""

    max_attempts = HandleBackend.max_attempts

    def __init__(self, *streams: FakeStream) -> None:
        self.streams = list(streams)
        self.opened: list[tuple[list[int], int, int]] = []

    def open(
        self, req: EngineRequest, index: int, num_prompts: int, key: str | None = None
    ) -> FakeStream:
        self.opened.append((req.prompt_token_ids, index, num_prompts))
        return self.streams.pop(0)

    async def kv_namespace(self) -> str | None:
        return None


def make_generation(retry_after_s: int = 3, backend: Any = None, limit: int = 100) -> Generation:
    args = AppArgs.model_validate(
        {"limits": {"retry_after_s": retry_after_s, "max_ongoing_per_ingress": limit}}
    )
    admission = Admission("test", args.limits.max_ongoing_per_ingress)
    return Generation(args, backend if backend is not None else FakeBackend(), admission)


def next_item(gen: Generation, stream: Any) -> Any:
    return asyncio.run(gen._next_item(stream))


def engine_error(
    status: int, message: str, type_: str, code: str | None = None, retryable: bool = False
) -> EngineError:
    return EngineError(status, message, type_, code, retryable)


def item(index: int, done: bool, replica: str = "r1") -> StreamItem:
    return StreamItem(
        replica_id=replica,
        index=index,
        token_ids=[7],
        text="x",
        finished=done,
        done=done,
        finish_reason="length" if done else None,
        stop_reason=None,
        prompt_tokens=1,
        completion_tokens=1,
        cached_tokens=0,
    )


def test_the_routed_layout_retries_and_the_direct_layout_does_not() -> None:
    assert MAX_ATTEMPTS > 1
    assert HandleBackend.max_attempts == MAX_ATTEMPTS
    assert LocalBackend.max_attempts == 1


def _unresolved_globals(deployment_class: type) -> list[tuple[str, str, str]]:
    """Names each method of our classes in ``deployment_class``'s MRO uses that its module
    defines but the method's globals lack."""
    missing = []
    checked = 0
    for cls in deployment_class.__mro__:
        if not cls.__module__.startswith("deployments."):
            continue
        module = vars(sys.modules[cls.__module__])
        checked += 1
        for name, attr in vars(cls).items():
            func = getattr(attr, "__func__", attr)
            code = getattr(func, "__code__", None)
            stack = [code] if code is not None else []
            while stack:
                c = stack.pop()
                missing += [
                    (cls.__qualname__, name, n)
                    for n in c.co_names
                    if n in module and n not in func.__globals__
                ]
                stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    assert checked >= 2  # the deployment's own class and the OpenAI routes, at least
    return missing


def test_every_class_global_resolves() -> None:
    """``serve.ingress`` copies the class at decoration time with the module's globals of that
    moment; a helper defined below the class is then a NameError (a 500) at request time."""
    assert _unresolved_globals(Ingress.func_or_class) == []
    direct = engine_server_deployment(AppArgs.model_validate({"layout": "direct"}))
    assert _unresolved_globals(direct.func_or_class) == []


def test_engine_handle_queue_full_is_429_with_retry_after() -> None:
    gen = make_generation(retry_after_s=3)
    with pytest.raises(HTTPError) as e:
        next_item(gen, FakeStream(BackPressureError(5, 4, status_code=429, retry_after_s=1.0)))
    assert e.value.status == 429
    assert e.value.type == "overloaded_error"
    assert e.value.headers == {"Retry-After": "3"}
    assert gen.admission.metrics.rejected["engine_queue"]._value.get() == 1


def test_full_engine_replica_is_retried_then_429_with_retry_after() -> None:
    gen = make_generation(retry_after_s=3)
    full = engine_error(429, "replica full", "overloaded_error", "overloaded")
    with pytest.raises(RetryableError) as e:
        next_item(gen, FakeStream(full))
    # No pause before trying another replica; if none has room, the answer is this 429.
    assert not e.value.backoff
    assert e.value.error.status == 429
    assert e.value.error.type == "overloaded_error"
    assert e.value.error.headers == {"Retry-After": "3"}
    assert gen.admission.metrics.rejected["engine_replica"]._value.get() == 1


@pytest.mark.parametrize(
    "outcome",
    [
        ActorDiedError(),
        engine_error(
            503, "engine loop died: RuntimeError()", "engine_error", "engine_dead", retryable=True
        ),
        None,  # the stream ends before its last item
    ],
    ids=["replica-died", "engine-loop-died", "stream-ended-early"],
)
def test_engine_failures_are_retryable_503s(outcome: Any) -> None:
    gen = make_generation()
    stream = FakeStream() if outcome is None else FakeStream(outcome)
    with pytest.raises(RetryableError) as e:
        next_item(gen, stream)
    assert e.value.backoff
    assert e.value.error.status == 503
    assert e.value.error.headers == {"Retry-After": "3"}


def test_unknown_engine_exception_is_503_not_500() -> None:
    with pytest.raises(HTTPError) as e:
        next_item(make_generation(), FakeStream(RuntimeError("boom")))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "3"}


def test_request_running_when_the_engine_died_is_not_retried() -> None:
    """It may be the request that broke the engine: retrying it could break the next one."""
    failed = engine_error(503, "engine loop died: RuntimeError()", "engine_error", "engine_failed")
    with pytest.raises(HTTPError) as e:
        next_item(make_generation(), FakeStream(failed))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "3"}


def test_client_errors_from_the_engine_keep_their_status() -> None:
    bad = engine_error(400, "bad", "invalid_request_error")
    with pytest.raises(HTTPError) as e:
        next_item(make_generation(), FakeStream(bad))
    assert e.value.status == 400 and e.value.headers is None


def test_lease_releases_once_and_cancels_the_unfinished_streams() -> None:
    admission = Admission("test", 100)
    lease = admission.lease(2, 6)  # two prompts, n=3
    done = admission.lease(1, 1)
    assert admission.inflight == 7
    lease.streams = [FakeStream(), FakeStream()]
    lease.ended[1] = True
    lease.release()
    lease.release()
    assert admission.inflight == 1
    assert [s.cancelled for s in lease.streams] == [1, 0]
    done.streams, done.ended = [FakeStream()], [True]
    done.release()
    assert admission.inflight == 0 and done.streams[0].cancelled == 0
    assert admission.metrics.peak == 7


class FakeHandle:
    """The Engine deployment's handle: ``options`` gives itself back; ``remote`` hands out
    scripted streams, one per call, and records the Serve internal request id each call was made
    under."""

    def __init__(self, *streams: FakeStream) -> None:
        self.streams = list(streams)
        self.calls: list[tuple[list[int], str]] = []
        self.options_kwargs: dict[str, Any] = {}

    def options(self, **kwargs: Any) -> FakeHandle:
        self.options_kwargs = kwargs
        return self

    def remote(self, req: Any) -> FakeStream:
        from ray.serve import context

        self.calls.append(
            (req.prompt_token_ids, context._get_serve_request_context()._internal_request_id)
        )
        return self.streams.pop(0)


def test_several_prompts_get_shifted_indexes_and_their_own_serve_request_ids() -> None:
    handle = FakeHandle(
        FakeStream(item(0, False), item(1, True)),
        FakeStream(item(1, False, "r2"), item(0, True, "r2")),
    )
    backend = HandleBackend(handle, by_reference=False)
    assert handle.options_kwargs == {
        "method_name": "generate",
        "stream": True,
        "_by_reference": False,
    }
    gen = make_generation(backend=backend)
    lease = gen.admission.lease(2, 2)
    reqs = [EngineRequest(f"p{i}", [i + 5], SamplingParams(), n=2) for i in range(2)]

    async def run() -> list:
        from ray.serve import context

        context._serve_request_context.set(context._RequestContext(_internal_request_id="http-1"))
        return await gather([gen._complete(lease, i, r, 2) for i, r in enumerate(reqs)])

    results = asyncio.run(run())
    assert [[i.index for i in its] for its in results] == [[0, 1], [3, 2]]
    assert lease.ended == [True, True]
    assert sorted(handle.calls) == [([5], "http-1-0"), ([6], "http-1-1")]


def test_one_failing_prompt_fails_the_request_and_cancels_the_others() -> None:
    slow = HangingStream()
    backend = FakeBackend(slow, FakeStream(engine_error(400, "bad", "invalid_request_error")))
    gen = make_generation(backend=backend)
    lease = gen.admission.lease(2, 2)
    reqs = [EngineRequest(f"p{i}", [i + 5], SamplingParams()) for i in range(2)]

    async def run() -> None:
        try:
            await gather([gen._complete(lease, i, r, 1) for i, r in enumerate(reqs)])
        finally:
            lease.release()

    with pytest.raises(HTTPError) as e:
        asyncio.run(run())
    assert e.value.status == 400
    assert slow.cancelled == 1 and gen.admission.inflight == 0
    assert len(backend.opened) == 2  # a client error is not retried


def test_a_prompt_that_failed_before_any_output_is_retried_up_to_max_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(generation_module, "RETRY_BACKOFF_S", 0.0)
    assert MAX_ATTEMPTS >= 3
    died = FakeStream(ActorDiedError())
    full = FakeStream(engine_error(429, "replica full", "overloaded_error", "overloaded"))
    served = FakeStream(item(0, True, "r3"))
    gen = make_generation(backend=FakeBackend(died, full, served))
    lease = gen.admission.lease(1, 1)
    req = EngineRequest("p", [5], SamplingParams())
    items = asyncio.run(gen._complete(lease, 0, req, 1))
    assert [(i.replica_id, i.index, i.done) for i in items] == [("r3", 0, True)]
    assert died.cancelled == 1 and full.cancelled == 1 and served.cancelled == 0
    assert lease.streams == [served] and lease.ended == [True]
    assert gen.admission.metrics.retries._value.get() == 2

    # Every attempt failed: the last failure is the answer.
    dead = [FakeStream(ActorDiedError()) for _ in range(MAX_ATTEMPTS)]
    gen = make_generation(backend=FakeBackend(*dead))
    with pytest.raises(HTTPError) as e:
        asyncio.run(gen._complete(gen.admission.lease(1, 1), 0, req, 1))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "3"}
    assert [s.cancelled for s in dead] == [1] * MAX_ATTEMPTS


def test_finished_stream_is_read_to_its_end() -> None:
    """Serve counts a request on its replica until the call ends, and a gRPC call ends only when
    its end is read: a finished stream is read once more, and cut off if something follows."""
    ended = FakeStream()
    asyncio.run(read_to_end(ended))
    assert ended.cancelled == 0
    extra = FakeStream(item(0, False), item(0, True))
    asyncio.run(read_to_end(extra))
    assert extra.cancelled == 1 and len(extra.outcomes) == 1
    failed = FakeStream(ActorDiedError())
    asyncio.run(read_to_end(failed))
    assert failed.cancelled == 1


def test_stream_that_never_ends_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_module, "READ_TO_END_TIMEOUT_S", 0.05)
    stream = HangingStream()
    asyncio.run(asyncio.wait_for(read_to_end(stream), 5.0))
    assert stream.cancelled == 1


class Closing:
    """An engine replica's ``generate`` stand-in: an async generator that yields ``items``, then
    waits forever; records how often it was closed and whether its ``finally`` ran."""

    def __init__(self, *items: Any, hang: bool = True) -> None:
        self.items, self.hang = items, hang
        self.acloses = 0
        self.finalized = 0
        self.agen = self._run()

    async def _run(self) -> AsyncIterator[Any]:
        try:
            for x in self.items:
                yield x
            if self.hang:
                await asyncio.sleep(3600)
        finally:
            self.finalized += 1

    def __anext__(self) -> Any:
        return self.agen.__anext__()

    async def aclose(self) -> None:
        self.acloses += 1
        await self.agen.aclose()


async def settle() -> None:
    """Let tasks scheduled so far (a stream's closing) run to their end."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_local_stream_passes_the_items_through() -> None:
    first, last = item(0, False), item(0, True)
    source = Closing(first, last, hang=False)

    async def run() -> list[Any]:
        stream = LocalStream(source)
        got = [await stream.__anext__(), await stream.__anext__()]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        return got

    got = asyncio.run(run())
    assert got[0] is first and got[1] is last
    assert source.finalized == 1 and source.acloses == 0


def test_local_stream_cancel_closes_the_generator_once() -> None:
    """Cancelling aborts the engine request: the generator is closed, so its ``finally`` (which
    gives back the replica's admission and aborts the engine request) runs; a second cancel (the
    lease's and the retry's) closes nothing more."""
    source = Closing(item(0, False))

    async def run() -> None:
        stream = LocalStream(source)
        assert (await stream.__anext__()).index == 0
        stream.cancel()
        stream.cancel()
        await settle()
        assert source.finalized == 1 and source.acloses == 1
        stream.cancel()
        await settle()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(run())
    assert source.finalized == 1 and source.acloses == 1


def test_local_stream_cancelled_before_its_first_item_closes_the_generator() -> None:
    source = Closing(item(0, True))

    async def run() -> None:
        stream = LocalStream(source)
        stream.cancel()
        await settle()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(run())
    # Never started, so nothing to undo: the body (and its ``finally``) never ran.
    assert source.acloses == 1 and source.finalized == 0


class LocalReplica:
    """An ``EngineReplica`` stand-in for ``LocalBackend``: each ``generate`` call streams the
    next scripted outcome."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.sources: list[Closing] = []

    def kv_namespace(self) -> str | None:
        return None

    def generate(self, req: EngineRequest) -> Closing:
        source = Closing(self.outcomes.pop(0), hang=False)
        self.sources.append(source)
        return source


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        (
            engine_error(
                503, "engine replica is shutting down", "engine_error", "engine_dead", True
            ),
            503,
        ),
        (engine_error(429, "replica full", "overloaded_error", "overloaded"), 429),
    ],
    ids=["engine-dead", "replica-full"],
)
def test_local_engine_failure_is_answered_at_once(
    monkeypatch: pytest.MonkeyPatch, outcome: EngineError, status: int
) -> None:
    """The direct layout has no other replica to try: an error another replica might not give
    is the answer, with no second attempt and no pause."""
    monkeypatch.setattr(generation_module, "RETRY_BACKOFF_S", 3600.0)
    replica = LocalReplica(outcome, item(0, True))
    gen = make_generation(backend=LocalBackend(replica))
    lease = gen.admission.lease(1, 1)
    req = EngineRequest("p", [5], SamplingParams())

    async def run() -> None:
        try:
            await asyncio.wait_for(gen._complete(lease, 0, req, 1), 5.0)
        finally:
            lease.release()
            await settle()

    with pytest.raises(HTTPError) as e:
        asyncio.run(run())
    assert e.value.status == status and e.value.headers == {"Retry-After": "3"}
    assert len(replica.sources) == 1 and len(replica.outcomes) == 1
    assert gen.admission.metrics.retries._value.get() == 0
    # The failed attempt's generator was closed.
    assert replica.sources[0].acloses >= 1 and replica.sources[0].finalized == 1
    assert gen.admission.inflight == 0


class EndlessReplica:
    """An ``EngineReplica`` stand-in for ``LocalBackend`` whose every request streams a token
    each 10 ms until it is closed (which aborts it); records the requests closed."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def kv_namespace(self) -> str | None:
        return None

    def generate(self, req: EngineRequest) -> AsyncIterator[StreamItem]:
        async def tokens() -> AsyncIterator[StreamItem]:
            try:
                for n in itertools.count(1):
                    await asyncio.sleep(0.01)
                    yield StreamItem("r1", 0, [7], "x", False, False, None, None, 2, n, 0)
            finally:
                self.closed.append(req.request_id)

        return tokens()


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_client_gone_mid_stream_aborts_every_local_engine_request(spec_version: str) -> None:
    """The direct layout streams two prompts and the client goes away while a chunk is being
    sent (Starlette then either cancels the send, ASGI < 2.4, or the send fails): when the
    response ends, both engine requests are closed, though the prompts' readers were waiting on
    them, and the request no longer counts in flight; not later, when the response object is
    collected (the server may hold it a while, a reference cycle until the next GC run)."""
    from starlette.requests import ClientDisconnect

    replica = EndlessReplica()
    gen = make_generation(backend=LocalBackend(replica))
    builder = ResponseBuilder("completion", "cmpl-1", "tiny", None, num_prompts=2)
    job = GenerationJob(
        prompts=[[5, 6], [7, 8]],
        params=SamplingParams(),
        builder=builder,
        n=1,
        stream=True,
        include_usage=False,
        priority=0,
    )

    async def run() -> None:
        response = await gen.run(job)
        assert gen.admission.inflight == 2  # two prompts, one sequence each
        third_chunk = asyncio.Event()
        chunks = 0

        async def send(message: dict[str, Any]) -> None:
            nonlocal chunks
            if message["type"] != "http.response.body":
                return
            chunks += 1
            if chunks == 3:
                third_chunk.set()
                if spec_version == "2.4":
                    raise OSError("connection reset by peer")
                await asyncio.sleep(3600)  # until the disconnect cancels it

        async def receive() -> dict[str, Any]:
            await third_chunk.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        with contextlib.suppress(ClientDisconnect):
            await asyncio.wait_for(response(scope, receive, send), 10.0)
        assert chunks == 3
        await settle()
        assert sorted(replica.closed) == ["cmpl-1-0", "cmpl-1-1"]
        assert gen.admission.inflight == 0
        del response

    asyncio.run(run())


UP = {"healthy": True}
DOWN = {"healthy": False}


@pytest.mark.parametrize(
    ("states", "reports", "deployment_status", "ok"),
    [
        ({"RUNNING": 2}, {"a": UP, "b": UP}, "HEALTHY", True),
        # One replica up and one still loading its model: not every replica can serve yet.
        ({"RUNNING": 1, "STARTING": 1}, {"a": UP}, "UPDATING", False),
        ({"RUNNING": 1, "RECOVERING": 1}, {"a": UP}, "HEALTHY", False),
        ({"RUNNING": 2}, {"a": UP, "b": DOWN}, "HEALTHY", False),
        # Serve says RUNNING before the replica's first report reached the registry.
        ({"RUNNING": 2}, {"a": UP}, "HEALTHY", False),
        ({"RUNNING": 2}, {"a": UP, "b": UP}, "UNHEALTHY", False),
        # A replica on its way out does not make the others unable to serve.
        ({"RUNNING": 2, "STOPPING": 1}, {"a": UP, "b": UP}, "DOWNSCALING", True),
        ({}, {}, None, False),
    ],
)
def test_health_is_ok_only_when_every_replica_can_serve(
    states: dict[str, int], reports: dict[str, Any], deployment_status: str | None, ok: bool
) -> None:
    verdict, body = health_verdict(states, reports, deployment_status)
    assert verdict is ok
    assert body["status"] == ("ok" if ok else "unavailable")
    assert body["replicas"] == states
    assert body["healthy_replicas"] == sorted(k for k, r in reports.items() if r["healthy"])


def test_serve_options_bound_every_queue_with_429() -> None:
    args = AppArgs.model_validate(
        {
            "engine": {"max_num_seqs": 8},
            "limits": {
                "max_waiting_per_replica": 4,
                "max_ongoing_per_ingress": 100,
                "max_queued_for_engine": 7,
                "max_queued_at_proxy": 9,
                "retry_after_s": 2,
            },
        }
    )
    engine, ingress = engine_serve_options(args), ingress_serve_options(args)
    # A replica admits 12 itself; Serve lets a few control calls past that.
    assert 12 < engine["max_ongoing_requests"] <= 12 + 16
    assert engine["max_queued_requests"] == 7
    assert 100 < ingress["max_ongoing_requests"] <= 100 + 8
    assert ingress["max_queued_requests"] == 9
    for options in (engine, ingress):
        assert options["backpressure_config"].status_code == 429
        assert options["backpressure_config"].retry_after_s == 2
    unbounded = AppArgs.model_validate({"limits": {"max_waiting_per_replica": None}})
    assert "max_ongoing_requests" not in engine_serve_options(unbounded)
    # By default the engine handle may queue what the ingress admits, and no more.
    default = AppArgs.model_validate({"limits": {"max_ongoing_per_ingress": 33}})
    assert engine_serve_options(default)["max_queued_requests"] == 33


def test_direct_layout_queue_limit_covers_a_burst_into_free_slots() -> None:
    """Serve's direct ingress counts each arrival as queued until it holds a slot: the queue
    limit must exceed the slots, or a burst into an idle replica gets 429s."""
    args = AppArgs.model_validate(
        {"layout": "direct", "limits": {"max_ongoing_per_ingress": 100, "max_queued_at_proxy": 9}}
    )
    deployment = engine_server_deployment(args)
    assert deployment.max_ongoing_requests >= 100
    assert deployment.max_queued_requests == deployment.max_ongoing_requests + 9


def test_dead_engine_is_detected_well_within_a_minute() -> None:
    """A dead engine loop fails every health check at once; Serve needs a few in a row."""
    detect_s = SERVE_UNHEALTHY_THRESHOLD * HEALTH_CHECK_PERIOD_S
    assert detect_s <= 10
    # A hung check counts as failed only after its timeout; still well inside 60 s.
    assert SERVE_UNHEALTHY_THRESHOLD * (HEALTH_CHECK_PERIOD_S + HEALTH_CHECK_TIMEOUT_S) <= 40
    options = engine_serve_options(AppArgs())
    assert options["health_check_period_s"] == HEALTH_CHECK_PERIOD_S
    assert options["health_check_timeout_s"] == HEALTH_CHECK_TIMEOUT_S


def test_replica_background_work_runs_outside_the_request_context() -> None:
    """Ray ties actor calls to the request whose context they run in and cancels them with it
    (a client disconnect); the replica's loops and registry calls must not inherit that."""
    from deployments.replica_report import detached

    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("rid", default=None)

    async def run() -> str | None:
        request_id.set("request-1")

        async def read() -> str | None:
            return request_id.get()

        return await detached(read())

    assert asyncio.run(run()) is None


class EndlessEngine:
    """An AsyncEngine stand-in whose every request streams a token each 10 ms, forever."""

    error = None

    async def generate(self, request_id: str, prompt: list[int], params: Any, **_: Any):
        from engine.outputs import RequestDelta

        for n in itertools.count(1):
            await asyncio.sleep(0.01)
            yield [RequestDelta(request_id, [7], "x", False, None, len(prompt), n, 0)]


def test_request_timeout_ends_the_stream_even_while_the_consumer_is_busy() -> None:
    """The deadline passes while the replica's generator waits at a yield for its consumer (the
    consumer is slower than the engine): every choice still ends with finish_reason timeout,
    rather than the consumer being cancelled wherever it happened to be."""
    from unittest.mock import Mock

    from deployments.engine_replica import EngineReplica

    replica = object.__new__(EngineReplica)
    replica.args = AppArgs.model_validate({"limits": {"request_timeout_s": 0.2}})
    replica.async_engine = EndlessEngine()
    replica.kv_sharing = None
    replica.coalesce_s = 0.0
    replica.replica_id = "r1"
    replica.metrics = Mock()

    req = EngineRequest("a", [5, 6], SamplingParams(), timeout_s=0.2, n=2)

    async def consume() -> list[StreamItem | EngineError]:
        items = []
        async for item in replica._generate(req):
            items.append(item)
            await asyncio.sleep(0.05)
        return items

    items = asyncio.run(consume())
    assert all(isinstance(i, StreamItem) for i in items), items
    ends = [i for i in items if i.finished]
    assert sorted(i.index for i in ends) == [0, 1]
    assert all(i.finish_reason == "timeout" for i in ends)
    assert items[-1].done and sum(i.done for i in items) == 1


def test_each_retry_has_a_request_id_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation_module, "RETRY_BACKOFF_S", 0.0)
    ids: list[str] = []

    class RecordingBackend(FakeBackend):
        def open(self, req: EngineRequest, index: int, num_prompts: int) -> FakeStream:
            ids.append(req.request_id)
            return super().open(req, index, num_prompts)

    backend = RecordingBackend(
        FakeStream(ActorDiedError()), FakeStream(ActorDiedError()), FakeStream(item(0, True))
    )
    gen = make_generation(backend=backend)
    req = EngineRequest("cmpl-1", [5], SamplingParams())
    asyncio.run(gen._complete(gen.admission.lease(1, 1), 0, req, 1))
    assert ids == ["cmpl-1", "cmpl-1-retry1", "cmpl-1-retry2"]
    assert req.request_id == "cmpl-1"  # the job's own request is left as it was


def test_a_failure_while_streaming_ends_with_an_error_event_and_done() -> None:
    """A bug past the first token (here: building a chunk) must not cut the stream short."""
    gen = make_generation()
    lease = gen.admission.lease(1, 1)
    lease.streams[0] = FakeStream(item(0, False), item(0, True))
    builder = ResponseBuilder("completion", "cmpl-1", "tiny", None)
    real_chunk = builder.chunk
    calls = 0

    def chunk(it: StreamItem) -> dict:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyError("a bug")
        return real_chunk(it)

    builder.chunk = chunk  # type: ignore[method-assign]

    async def run() -> list[bytes]:
        req = EngineRequest("cmpl-1", [5], SamplingParams())
        return [b async for b in gen._sse(lease, [req], [item(0, False)], builder, False)]

    events = asyncio.run(run())
    assert events[-1] == b"data: [DONE]\n\n"
    err = json.loads(events[-2][len(b"data: ") :])["error"]
    assert err["type"] == "internal_server_error" and "bug" not in err["message"]
    assert gen.admission.inflight == 0


def test_a_bad_model_fails_the_build_not_each_replica(tmp_path: Path) -> None:
    """``serve run`` / ``serve deploy`` report a bad model once, when the app is built."""
    with pytest.raises(ValueError, match="^model: "):
        build_app({"model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="^tokenizer: "):
        build_app({"tokenizer": str(tmp_path / "missing")})
