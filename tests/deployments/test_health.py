"""Without a cluster: ``/health`` answers from a verdict refreshed in the background (one refresh
however many calls come at once, unavailable once the verdict is stale or a refresh fails, no
internals in any body), and the API key guards ``/health``, ``/metrics`` and ``/version`` but
not ``/ping``. The routes run through ``serve.ingress`` and FastAPI's test client, with the
replica context that Serve would provide faked."""

from __future__ import annotations

import asyncio
import contextvars
import importlib.metadata
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from ray import serve

from deployments.frontend import OpenAIFrontend, openai_routes
from deployments.health import CachedVerdict, EngineStates, EngineStatesCache, Verdict, unavailable

OK: Verdict = (True, {"status": "ok", "replicas": {"RUNNING": 2}, "healthy_replicas": ["a", "b"]})
SECRET = "ActorDiedError: registry at 10.0.0.7:6379 (pid 4242)"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Computations:
    """A verdict source that counts its calls; each waits ``delay_s`` and then returns the next
    of ``outcomes`` (the last one repeats); an exception is raised, ``None`` hangs."""

    def __init__(self, *outcomes: Verdict | BaseException | None, delay_s: float = 0.0) -> None:
        self.outcomes = list(outcomes)
        self.delay_s = delay_s
        self.calls = 0

    async def __call__(self) -> Verdict:
        out = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if out is None:
            await asyncio.Event().wait()
        if isinstance(out, BaseException):
            raise out
        assert out is not None
        return out


def test_concurrent_calls_share_one_refresh_and_later_calls_make_none() -> None:
    compute = Computations(OK, delay_s=0.05)
    cache = CachedVerdict(compute, period_s=60.0)

    async def run() -> tuple[list[Verdict], list[Verdict]]:
        first = await asyncio.gather(*(cache.get() for _ in range(100)))
        second = await asyncio.gather(*(cache.get() for _ in range(100)))
        return first, second

    first, second = asyncio.run(run())
    assert first == [OK] * 100 and second == [OK] * 100
    assert compute.calls == 1 and cache.refreshes == 1


def test_calls_answer_at_once_from_the_cache_while_a_refresh_is_slow() -> None:
    compute = Computations(OK, None)  # the second refresh never returns
    cache = CachedVerdict(compute, period_s=0.01, timeout_s=60.0)

    async def run() -> list[Verdict]:
        await cache.get()
        while compute.calls < 2:
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(asyncio.gather(*(cache.get() for _ in range(50))), 1.0)

    assert asyncio.run(run()) == [OK] * 50
    assert compute.calls == 2


def test_a_stale_verdict_answers_unavailable() -> None:
    clock = Clock()
    compute = Computations(OK, None)  # the refresher gets stuck after its first refresh
    cache = CachedVerdict(compute, period_s=0.01, timeout_s=600.0, max_age_s=10.0, clock=clock)

    async def run() -> tuple[Verdict, Verdict, Verdict]:
        fresh = await cache.get()
        clock.now += 9.0
        aging = await cache.get()
        clock.now += 2.0
        stale = await asyncio.wait_for(cache.get(), 1.0)
        return fresh, aging, stale

    fresh, aging, stale = asyncio.run(run())
    assert fresh == OK and aging == OK
    assert stale == unavailable() == (False, {"status": "unavailable"})


@pytest.mark.parametrize(
    "outcome", [RuntimeError(SECRET), TimeoutError(SECRET), None], ids=["raises", "times", "hangs"]
)
def test_a_failed_or_overrunning_refresh_answers_unavailable(
    outcome: BaseException | None,
) -> None:
    cache = CachedVerdict(Computations(outcome), period_s=60.0, timeout_s=0.1)
    assert asyncio.run(asyncio.wait_for(cache.get(), 5.0)) == unavailable()


def test_an_idle_refresher_stops_and_the_next_call_waits_for_a_fresh_verdict() -> None:
    clock = Clock()
    down: Verdict = (False, {"status": "unavailable", "replicas": {}, "healthy_replicas": []})
    compute = Computations(OK, down)
    cache = CachedVerdict(compute, period_s=0.01, idle_stop_s=30.0, clock=clock)

    async def run() -> tuple[Verdict, Verdict]:
        first = await cache.get()
        clock.now += 31.0  # nobody asked since: the refresher ends after its next refresh
        assert cache._task is not None
        await asyncio.wait_for(cache._task, 1.0)
        calls = compute.calls
        await asyncio.sleep(0.05)
        assert compute.calls == calls  # stopped: no refreshes while nobody asks
        clock.now += 100.0  # the last verdict is long stale, but a call restarts the refresher
        return first, await cache.get()

    first, again = asyncio.run(run())
    assert first == OK
    assert again == down  # the fresh verdict, not the stale one nor a stale-verdict 503


def test_the_refresher_runs_outside_the_first_callers_context() -> None:
    """Ray cancels a request's actor calls when its client goes away: the refresher started by
    one request must not make its calls in that request's context."""
    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("rid", default=None)
    seen: list[str | None] = []

    async def compute() -> Verdict:
        seen.append(request_id.get())
        return OK

    async def run() -> Verdict:
        request_id.set("request-1")
        return await CachedVerdict(compute, period_s=60.0).get()

    assert asyncio.run(run()) == OK
    assert seen == [None]


# -- the routes ----------------------------------------------------------------------------------

KEY = "s3cret"


def frontend(api_key: str | None, compute: Any) -> OpenAIFrontend:
    """An ``OpenAIFrontend`` with only what the control routes use (no model, no tokenizer)."""
    fe = object.__new__(OpenAIFrontend)
    fe.api_key = api_key
    fe.health_cache = CachedVerdict(compute, period_s=60.0, timeout_s=0.5)

    async def reports() -> dict[str, dict[str, Any]]:
        return {}

    fe.reports = reports
    fe.admission = SimpleNamespace(metrics=SimpleNamespace(render=lambda: b"# admission\n"))
    return fe


@pytest.fixture
def serve_routes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make(frontend) -> TestClient`` over the real routes, as ``serve.ingress`` wires them."""
    clients: list[TestClient] = []

    def make(fe: OpenAIFrontend) -> TestClient:
        app, routes = openai_routes()

        class Server(routes):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                self.frontend = fe

        serve.ingress(app)(Server)
        server = Server()
        monkeypatch.setattr(
            serve, "get_replica_context", lambda: SimpleNamespace(servable_object=server)
        )
        # Entered: one event loop for all of a test's requests, as in a replica.
        client = TestClient(app).__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", KEY])
def test_health_metrics_and_version_require_the_key(
    serve_routes: Any, path: str, header: str
) -> None:
    compute = Computations(OK)
    client = serve_routes(frontend(KEY, compute))
    r = client.get(path, headers={} if header is None else {"Authorization": header})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert compute.calls == 0  # refused before any work


def test_the_key_opens_health_and_metrics(serve_routes: Any) -> None:
    client = serve_routes(frontend(KEY, Computations(OK)))
    auth = {"Authorization": f"Bearer {KEY}"}
    health = client.get("/health", headers=auth)
    assert health.status_code == 200 and health.json() == OK[1]
    metrics = client.get("/metrics", headers=auth)
    assert metrics.status_code == 200 and "# admission" in metrics.text


def test_version_names_the_installed_package_as_vllm_shapes_it(serve_routes: Any) -> None:
    client = serve_routes(frontend(KEY, Computations(OK)))
    r = client.get("/version", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("prefixserve")}


def test_without_a_key_health_and_metrics_are_open(serve_routes: Any) -> None:
    client = serve_routes(frontend(None, Computations(OK)))
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("api_key", [KEY, None])
def test_ping_is_open_and_answers_from_the_process_alone(
    serve_routes: Any, api_key: Any, method: str
) -> None:
    compute = Computations(RuntimeError(SECRET))  # the cluster cannot even be asked
    client = serve_routes(frontend(api_key, compute))
    r = client.request(method, "/ping")
    assert r.status_code == 200 and r.json() == {"status": "alive"}
    assert compute.calls == 0


@pytest.mark.parametrize("outcome", [RuntimeError(SECRET), None], ids=["raises", "hangs"])
def test_an_unavailable_health_body_carries_no_internals(serve_routes: Any, outcome: Any) -> None:
    client = serve_routes(frontend(KEY, Computations(outcome)))
    r = client.get("/health", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503
    assert r.json() == {"status": "unavailable"}
    for leak in ("Error", "10.0.0.7", "4242", "Traceback"):
        assert leak not in r.text


def test_metrics_unavailable_carries_no_internals(serve_routes: Any) -> None:
    fe = frontend(None, Computations(OK))

    async def broken() -> dict[str, dict[str, Any]]:
        raise RuntimeError(SECRET)

    fe.reports = broken
    r = serve_routes(fe).get("/metrics")
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "metrics unavailable"
    assert "Error" not in r.text and "10.0.0.7" not in r.text


RUNNING = EngineStates({"RUNNING": 2}, "HEALTHY")


class StateReads:
    """Serve's view as ``read_engine_states`` would return it, one of ``views`` per call (the
    last repeats), counting the calls."""

    def __init__(self, *views: EngineStates) -> None:
        self.views = list(views)
        self.calls = 0

    def __call__(self) -> EngineStates:
        view = self.views[min(self.calls, len(self.views) - 1)]
        self.calls += 1
        return view


def test_a_steady_view_of_serve_is_read_once_per_period() -> None:
    clock, reads = Clock(), StateReads(RUNNING)
    cache = EngineStatesCache(reads, period_s=10.0, clock=clock)
    both = frozenset({"a", "b"})

    async def run() -> None:
        for _ in range(5):
            assert await cache.get(both) == RUNNING
            clock.now += 1.0
        assert reads.calls == 1
        clock.now += 6.0  # 11 s after the read
        await cache.get(both)
        assert reads.calls == 2

    asyncio.run(run())


def test_serve_is_asked_again_when_the_reporting_replicas_change() -> None:
    reads = StateReads(RUNNING, EngineStates({"RUNNING": 3}, "HEALTHY"))
    cache = EngineStatesCache(reads, period_s=10.0, clock=Clock())

    async def run() -> None:
        await cache.get(frozenset({"a", "b"}))
        assert (await cache.get(frozenset({"a", "b", "c"}))).states == {"RUNNING": 3}
        await cache.get(frozenset({"a", "b", "c"}))
        assert reads.calls == 2
        await cache.get(frozenset({"a", "c"}))  # b died
        assert reads.calls == 3

    asyncio.run(run())


@pytest.mark.parametrize(
    "unsteady",
    [
        EngineStates({"RUNNING": 1, "STARTING": 1}, "UPDATING"),
        EngineStates({"RUNNING": 2}, "UNHEALTHY"),
        EngineStates({}, None),
    ],
)
def test_a_view_that_is_about_to_change_is_read_on_every_refresh(unsteady: EngineStates) -> None:
    """A replica starting (or a deployment unhealthy) need not change who reports when it ends,
    so such a view is never reused: /health turns ok on the first refresh after it does."""
    reads = StateReads(unsteady, unsteady, RUNNING)
    cache = EngineStatesCache(reads, period_s=10.0, clock=Clock())
    reporting = frozenset({"a"})

    async def run() -> list[EngineStates]:
        return [await cache.get(reporting) for _ in range(4)]

    assert asyncio.run(run()) == [unsteady, unsteady, RUNNING, RUNNING]
    assert reads.calls == 3
