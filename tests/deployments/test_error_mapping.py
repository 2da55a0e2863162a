"""Without a cluster: how the ingress maps every engine-side failure to an HTTP answer, and the
Serve options that bound every queue. Every overload path must be a 429 with Retry-After, every
engine failure a 503 with Retry-After (retried first when nothing reached the client)."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from typing import Any

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

import deployments.ingress as ingress_module
from deployments.app import (
    HEALTH_CHECK_PERIOD_S,
    HEALTH_CHECK_TIMEOUT_S,
    engine_serve_options,
    ingress_serve_options,
)
from deployments.config import AppArgs
from deployments.engine_request import EngineRequest, error_item
from deployments.ingress import (
    HTTPError,
    Ingress,
    IngressMetrics,
    _Lease,
    _read_to_end,
    _RetryableError,
    health_verdict,
)

# Serve replaces a replica after this many failed health checks in a row.
SERVE_UNHEALTHY_THRESHOLD = 3


def ingress_class() -> type:
    """The class Serve runs: ``serve.ingress`` wraps (and copies) the one in the module."""
    return Ingress.func_or_class


def user_class() -> type:
    """The copy of our class inside Serve's wrapper (the wrapper has an async ``__del__``)."""
    return next(c for c in ingress_class().__mro__ if "_next_item" in vars(c))


def make_ingress(retry_after_s: int = 3) -> Any:
    ing = object.__new__(user_class())
    ing.args = AppArgs.model_validate({"limits": {"retry_after_s": retry_after_s}})
    ing.retry_after = {"Retry-After": str(retry_after_s)}
    ing.ingress_metrics = IngressMetrics("test")
    ing.inflight = 0
    return ing


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


def next_item(ing: Any, stream: FakeStream) -> Any:
    return asyncio.run(ing._next_item(stream))


def test_every_class_global_resolves() -> None:
    """``serve.ingress`` copies the class at decoration time with the module's globals of that
    moment; a helper defined below the class is then a NameError (a 500) at request time."""
    missing = []
    for cls in ingress_class().__mro__:
        if cls.__module__ != ingress_module.__name__:
            continue
        for name, attr in vars(cls).items():
            func = getattr(attr, "__func__", attr)
            code = getattr(func, "__code__", None)
            stack = [code] if code is not None else []
            while stack:
                c = stack.pop()
                missing += [
                    (name, n)
                    for n in c.co_names
                    if n in vars(ingress_module) and n not in func.__globals__
                ]
                stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    assert missing == []


def test_engine_handle_queue_full_is_429_with_retry_after() -> None:
    ing = make_ingress(retry_after_s=3)
    with pytest.raises(HTTPError) as e:
        next_item(ing, FakeStream(BackPressureError(5, 4, status_code=429, retry_after_s=1.0)))
    assert e.value.status == 429
    assert e.value.type == "overloaded_error"
    assert e.value.headers == {"Retry-After": "3"}
    assert ing.ingress_metrics.rejected["engine_queue"]._value.get() == 1


def test_full_engine_replica_is_retried_then_429_with_retry_after() -> None:
    ing = make_ingress(retry_after_s=3)
    item = error_item(429, "replica full", "overloaded_error", "overloaded")
    with pytest.raises(_RetryableError) as e:
        next_item(ing, FakeStream(item))
    # No pause before trying another replica; if none has room, the answer is this 429.
    assert not e.value.backoff
    assert e.value.error.status == 429
    assert e.value.error.type == "overloaded_error"
    assert e.value.error.headers == {"Retry-After": "3"}
    assert ing.ingress_metrics.rejected["engine_replica"]._value.get() == 1


@pytest.mark.parametrize(
    "outcome",
    [
        ActorDiedError(),
        error_item(503, "engine loop died: RuntimeError()", "engine_error", "engine_dead"),
        None,  # the stream ends before its last item
    ],
    ids=["replica-died", "engine-loop-died", "stream-ended-early"],
)
def test_engine_failures_are_retryable_503s(outcome: Any) -> None:
    ing = make_ingress()
    stream = FakeStream() if outcome is None else FakeStream(outcome)
    with pytest.raises(_RetryableError) as e:
        next_item(ing, stream)
    assert e.value.backoff
    assert e.value.error.status == 503
    assert e.value.error.headers == {"Retry-After": "3"}


def test_unknown_engine_exception_is_503_not_500() -> None:
    with pytest.raises(HTTPError) as e:
        next_item(make_ingress(), FakeStream(RuntimeError("boom")))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "3"}


def test_request_running_when_the_engine_died_is_not_retried() -> None:
    """It may be the request that broke the engine: retrying it could break the next one."""
    item = error_item(503, "engine loop died: RuntimeError()", "engine_error", "engine_failed")
    with pytest.raises(HTTPError) as e:
        next_item(make_ingress(), FakeStream(item))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "3"}


def test_client_errors_from_the_engine_keep_their_status() -> None:
    with pytest.raises(HTTPError) as e:
        next_item(make_ingress(), FakeStream(error_item(400, "bad", "invalid_request_error")))
    assert e.value.status == 400 and e.value.headers is None


def test_lease_releases_once_and_cancels_the_unfinished_streams() -> None:
    ing = make_ingress()
    ing.set_in_flight(2)
    lease = _Lease(ing, 2)
    lease.streams = [FakeStream(), FakeStream()]
    lease.ended[1] = True
    lease.release()
    lease.release()
    assert ing.inflight == 1
    assert [s.cancelled for s in lease.streams] == [1, 0]
    done = _Lease(ing)
    done.streams, done.ended = [FakeStream()], [True]
    done.release()
    assert ing.inflight == 0 and done.streams[0].cancelled == 0
    assert ing.ingress_metrics.peak == 2


def item(index: int, done: bool, replica: str = "r1") -> dict[str, Any]:
    return {"replica_id": replica, "index": index, "text": "x", "done": done}


class FakeHandle:
    """``generate_handle``: hands out scripted streams, one per call, and records the Serve
    internal request id each call was made under."""

    def __init__(self, *streams: FakeStream) -> None:
        self.streams = list(streams)
        self.calls: list[tuple[str, str]] = []

    def remote(self, req: Any) -> FakeStream:
        from ray.serve import context

        self.calls.append(
            (req.prompt_token_ids, context._get_serve_request_context()._internal_request_id)
        )
        return self.streams.pop(0)


def test_several_prompts_get_shifted_indexes_and_their_own_serve_request_ids() -> None:
    ing = make_ingress()
    ing.generate_handle = FakeHandle(
        FakeStream(item(0, False), item(1, True)),
        FakeStream(item(1, False, "r2"), item(0, True, "r2")),
    )
    lease = _Lease(ing, 2)
    reqs = [EngineRequest(f"p{i}", [i + 5], {}, n=2) for i in range(2)]

    async def run() -> list:
        from ray.serve import context

        context._serve_request_context.set(context._RequestContext(_internal_request_id="http-1"))
        return await ingress_module._gather(
            [ing._complete(lease, i, r, 2) for i, r in enumerate(reqs)]
        )

    results = asyncio.run(run())
    assert [[i["index"] for i in its] for its in results] == [[0, 1], [3, 2]]
    assert lease.ended == [True, True]
    assert sorted(ing.generate_handle.calls) == [([5], "http-1-0"), ([6], "http-1-1")]


def test_one_failing_prompt_fails_the_request_and_cancels_the_others() -> None:
    ing = make_ingress()
    slow = HangingStream()
    ing.generate_handle = FakeHandle(
        slow, FakeStream(error_item(400, "bad", "invalid_request_error"))
    )
    ing.set_in_flight(1)
    lease = _Lease(ing, 2)
    reqs = [EngineRequest(f"p{i}", [i + 5], {}) for i in range(2)]

    async def run() -> None:
        try:
            await ingress_module._gather(
                [ing._complete(lease, i, r, 1) for i, r in enumerate(reqs)]
            )
        finally:
            lease.release()

    with pytest.raises(HTTPError) as e:
        asyncio.run(run())
    assert e.value.status == 400
    assert slow.cancelled == 1 and ing.inflight == 0


class HangingStream(FakeStream):
    async def __anext__(self) -> Any:
        await asyncio.sleep(3600)


def test_finished_stream_is_read_to_its_end() -> None:
    """Serve counts a request on its replica until the call ends, and a gRPC call ends only when
    its end is read: a finished stream is read once more, and cut off if something follows."""
    ended = FakeStream()
    asyncio.run(_read_to_end(ended))
    assert ended.cancelled == 0
    extra = FakeStream({"token_ids": [1]}, {"token_ids": [2]})
    asyncio.run(_read_to_end(extra))
    assert extra.cancelled == 1 and len(extra.outcomes) == 1
    failed = FakeStream(ActorDiedError())
    asyncio.run(_read_to_end(failed))
    assert failed.cancelled == 1


def test_stream_that_never_ends_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress_module, "READ_TO_END_TIMEOUT_S", 0.05)
    stream = HangingStream()
    asyncio.run(asyncio.wait_for(_read_to_end(stream), 5.0))
    assert stream.cancelled == 1


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
    from deployments.engine_replica import _detached

    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("rid", default=None)

    async def run() -> str | None:
        request_id.set("request-1")

        async def read() -> str | None:
            return request_id.get()

        return await _detached(read())

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

    async def consume() -> list[dict[str, Any]]:
        items = []
        async for item in replica._generate(EngineRequest("a", [5, 6], {}, timeout_s=0.2, n=2)):
            items.append(item)
            await asyncio.sleep(0.05)
        return items

    items = asyncio.run(consume())
    ends = [i for i in items if i["finished"]]
    assert sorted(i["index"] for i in ends) == [0, 1]
    assert all(i["finish_reason"] == "timeout" for i in ends)
    assert items[-1]["done"] and sum(i["done"] for i in items) == 1
