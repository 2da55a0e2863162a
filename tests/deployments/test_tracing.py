"""OpenTelemetry traces of requests, read back through the SDK's in-memory exporter.

The HTTP side and the engine replica run in this process, as the direct layout runs them: the
real routes, validator, generation and ``EngineReplica.generate`` over an ``AsyncEngine`` with a
tiny random Llama (SmolLM2's tokenizer); the request router is the class Serve ships, fed fake
replicas (see tests/router/test_request_router.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ray import serve

from deployments import tracing
from deployments.config import AppArgs
from deployments.engine_replica import EngineReplica
from deployments.engine_request import EngineRequest
from deployments.engine_server import LocalBackend
from deployments.frontend import OpenAIFrontend, openai_routes
from deployments.metrics import AdmittedCounts, ReplicaMetrics
from engine.async_engine import AsyncEngine
from tests.deployments.support import sse_payloads
from tests.engine.helpers import make_engine
from tests.router.support import BLOCK, report
from tests.router.test_request_router import FakeReplica, make_router, pending

ROOT = Path(__file__).resolve().parents[2]
REPLICA = "replica-1"
ENDPOINT = "http://127.0.0.1:9/v1/traces"  # never dialled: the tests' tracer exports in memory
CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
PHASES = ("engine.queue", "engine.prefill", "engine.decode")


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The process's tracer, exporting to memory; no OTLP endpoint in the environment."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use_tracer(provider.get_tracer(tracing.TRACER_NAME))
    yield memory
    tracing.use_tracer(None)
    provider.shutdown()


@pytest.fixture
def engine(tiny_llama_with_tokenizer: Path) -> Iterator[AsyncEngine]:
    """One per test: the replica owns it, and shuts it down when it is collected."""
    async_engine = AsyncEngine(make_engine(tiny_llama_with_tokenizer, num_threads=1))
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture
def serve_app(
    monkeypatch: pytest.MonkeyPatch, engine: AsyncEngine, tiny_llama_with_tokenizer: Path
) -> Iterator[Callable[[str | None], TestClient]]:
    """``make(endpoint) -> TestClient``: the direct layout's routes over an engine replica in
    this process, with ``otlp_traces_endpoint`` set to ``endpoint``."""
    clients: list[TestClient] = []

    def make(endpoint: str | None) -> TestClient:
        args = AppArgs(
            model=str(tiny_llama_with_tokenizer),
            served_model_name="tiny",
            engine={"dtype": "float32", "num_kv_blocks": 256},
            stream_interval_ms=0,
            otlp_traces_endpoint=endpoint,
        )
        replica = _replica(args, engine)
        app, routes = openai_routes()

        class Server(routes):  # type: ignore[misc, valid-type]
            pass  # nothing from this scope: serve.ingress pickles the class with the app

        serve.ingress(app)(Server)
        server = Server()
        server.frontend = OpenAIFrontend(args, LocalBackend(replica), REPLICA, reports=None)  # type: ignore[arg-type]
        monkeypatch.setattr(
            serve, "get_replica_context", lambda: SimpleNamespace(servable_object=server)
        )
        client = TestClient(app).__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _replica(args: AppArgs, engine: AsyncEngine) -> EngineReplica:
    """``EngineReplica`` as its constructor leaves it, less what needs Serve and Ray (the
    replica context, the reporter's registry, KV sharing)."""
    replica = object.__new__(EngineReplica)
    replica.args = args
    replica.replica_id = REPLICA
    replica.tracer = tracing.setup(args.otlp_traces_endpoint)
    replica.engine = engine.engine
    replica.async_engine = engine
    replica.kv_sharing = None
    replica.coalesce_s = args.stream_interval_ms / 1000.0
    replica.metrics = ReplicaMetrics(REPLICA, args.model_name)
    replica.reporter = SimpleNamespace(ensure_started=lambda: None)
    replica.admitted = AdmittedCounts(replica.metrics.registry, REPLICA, "colocated")
    return replica


def _finished(exporter: InMemorySpanExporter, names: set[str]) -> dict[str, ReadableSpan]:
    """The exported spans by name, once every one of ``names`` has ended (a stream's span ends
    after its last byte went out, which the client may see first)."""
    deadline = time.monotonic() + 10.0
    while True:
        spans = {s.name: s for s in exporter.get_finished_spans()}
        if names <= spans.keys() or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def _completion(client: TestClient, stream: bool, headers: dict[str, str]) -> dict[str, Any]:
    """Send one completion; what the response said: id, usage, the serving replica."""
    body = {
        "model": "tiny",
        "prompt": "Tracing follows one request from the socket to the last token",
        "max_tokens": 5,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    if not stream:
        r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"id": data["id"], "usage": data["usage"], "replica": r.headers["x-engine-replica"]}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
        replica = r.headers["x-engine-replica"]
    assert events[-1] == "[DONE]"
    usage = next(e["usage"] for e in events[:-1] if e.get("usage"))
    return {"id": events[0]["id"], "usage": usage, "replica": replica}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_one_request_yields_the_listed_spans(
    exporter: InMemorySpanExporter, serve_app: Callable[[str | None], TestClient], stream: bool
) -> None:
    client = serve_app(ENDPOINT)
    answer = _completion(
        client, stream, {"traceparent": TRACEPARENT, "x-request-id": "req-trace-1"}
    )
    http_name = "POST /v1/completions"
    spans = _finished(exporter, {http_name, "engine_replica", *PHASES})
    assert sorted(spans) == sorted([http_name, "engine_replica", *PHASES])
    http, replica = spans[http_name], spans["engine_replica"]
    queue, prefill, decode = (spans[p] for p in PHASES)

    # One trace, the client's; each span the child of the one above it.
    assert {s.context.trace_id for s in spans.values()} == {CLIENT_TRACE_ID}
    assert http.parent is not None and http.parent.span_id == CLIENT_SPAN_ID
    assert replica.parent is not None and replica.parent.span_id == http.context.span_id
    for phase in (queue, prefill, decode):
        assert phase.parent is not None and phase.parent.span_id == replica.context.span_id

    usage = answer["usage"]
    assert http.kind.name == "SERVER"
    assert http.attributes["gen_ai.response.id"] == answer["id"]
    assert http.attributes["http.request.header.x-request-id"] == ("req-trace-1",)
    assert http.attributes["gen_ai.request.model"] == "tiny"
    assert http.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert http.attributes["http.response.status_code"] == 200
    assert replica.attributes["prefixserve.replica_id"] == answer["replica"] == REPLICA
    assert replica.attributes["gen_ai.request.id"] == answer["id"]
    assert replica.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert replica.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert prefill.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert decode.attributes["gen_ai.usage.completion_tokens"] == 5
    assert decode.attributes["gen_ai.response.finish_reasons"] == ("length",)

    # The engine's phases follow one another inside the replica's span, inside the request's.
    assert http.start_time <= replica.start_time <= queue.start_time
    assert queue.end_time == pytest.approx(prefill.start_time, abs=1_000)
    assert prefill.end_time == pytest.approx(decode.start_time, abs=1_000)
    assert queue.start_time < prefill.start_time < decode.start_time < decode.end_time
    assert decode.end_time <= replica.end_time <= http.end_time


def test_without_a_traceparent_the_request_starts_a_trace(
    exporter: InMemorySpanExporter, serve_app: Callable[[str | None], TestClient]
) -> None:
    _completion(serve_app(ENDPOINT), False, {})
    spans = _finished(exporter, {"POST /v1/completions", "engine_replica", *PHASES})
    http = spans["POST /v1/completions"]
    assert http.parent is None
    assert {s.context.trace_id for s in spans.values()} == {http.context.trace_id}


def test_an_error_answer_is_on_the_request_span(
    exporter: InMemorySpanExporter, serve_app: Callable[[str | None], TestClient]
) -> None:
    client = serve_app(ENDPOINT)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    (span,) = _finished(exporter, {"POST /v1/completions"}).values()
    assert span.attributes["http.response.status_code"] == 400
    # A client's error: no error status on a SERVER span (OpenTelemetry's HTTP conventions).
    assert span.status.status_code.name == "UNSET"


def test_off_by_default_no_spans(
    exporter: InMemorySpanExporter, serve_app: Callable[[str | None], TestClient]
) -> None:
    """Without an endpoint the routes and the replica make no span, though this process has a
    tracer (another application's in the same process could)."""
    client = serve_app(None)
    answer = _completion(client, False, {"traceparent": TRACEPARENT})
    assert answer["usage"]["completion_tokens"] == 5
    time.sleep(0.2)
    assert exporter.get_finished_spans() == ()
    assert tracing.setup(AppArgs().otlp_traces_endpoint) is None


def test_the_standard_environment_turns_tracing_on_and_off() -> None:
    assert not tracing.enabled(None, {})
    assert tracing.enabled(ENDPOINT, {})
    assert tracing.enabled(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT})
    assert not tracing.enabled(ENDPOINT, {"OTEL_SDK_DISABLED": "true"})
    assert not tracing.enabled(ENDPOINT, {"OTEL_TRACES_EXPORTER": "none"})


def test_off_imports_nothing_of_opentelemetry() -> None:
    """Every module on the request path imports ``deployments.tracing``; it alone, and setting
    up with tracing off, must not import OpenTelemetry (Ray may, for its own metrics)."""
    code = (
        "import sys; from deployments import tracing; "
        "assert tracing.setup(None) is None; "
        "print([m for m in sys.modules if m.startswith('opentelemetry')])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_a_routing_decision_is_a_child_span_with_its_reason_and_predicted_hit(
    exporter: InMemorySpanExporter,
) -> None:
    import asyncio

    from opentelemetry import propagate, trace

    hashes = list(range(900, 910))
    parent = tracing.active().start_span("POST /v1/completions")  # type: ignore[union-attr]
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(parent))

    async def body() -> None:
        router = make_router(imbalance_abs=100)
        now = time.time()
        a = FakeReplica("a", report("a", hashes[:6], at=now))
        b = FakeReplica("b", report("b", [], at=now))
        router.update_replicas([a, b])
        await asyncio.sleep(0)
        traced = EngineRequest("cmpl-7", list(range(170)), block_hashes=hashes)
        traced.trace_context = carrier
        ranks = await router.choose_replicas([a, b], pending(traced, "r1"))
        assert ranks[0][0].replica_id.unique_id == "a"
        # A request that carries no context (tracing off at its HTTP side) makes no span.
        untraced = EngineRequest("cmpl-8", list(range(170)), block_hashes=hashes)
        await router.choose_replicas([a, b], pending(untraced, "r2"))

    asyncio.run(body())
    parent.end()
    (route,) = [s for s in exporter.get_finished_spans() if s.name == "route"]
    assert route.parent is not None and route.parent.span_id == parent.get_span_context().span_id
    assert route.context.trace_id == parent.get_span_context().trace_id
    assert route.attributes["prefixserve.routing.replica_id"] == "a"
    assert route.attributes["prefixserve.routing.reason"] == "prefix"
    assert route.attributes["prefixserve.routing.policy"] == "prefix_aware"
    assert route.attributes["prefixserve.routing.predicted_hit_blocks"] == 6
    assert route.attributes["prefixserve.routing.predicted_hit_tokens"] == 6 * BLOCK
    assert route.attributes["gen_ai.request.id"] == "cmpl-7"
