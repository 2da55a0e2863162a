"""OpenTelemetry spans of each generation request; optional (the ``tracing`` extra), off by default.

On in a process when ``AppArgs.otlp_traces_endpoint`` is set (``--otlp-traces-endpoint``, as
vLLM names it) or the environment names an OTLP traces endpoint
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keep it off. The rest is the SDK's own ``OTEL_*`` handling:
``OTEL_SERVICE_NAME`` (default ``prefixserve``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_PROPAGATORS`` and the exporter's ``OTEL_EXPORTER_OTLP_TRACES_*``
(``_PROTOCOL``: ``http/protobuf`` by default, ``grpc`` with the gRPC exporter installed).

Zero cost when off: importing this module imports nothing of OpenTelemetry; ``setup`` returns
None and every caller tests for None before it calls anything else here.

The spans of one request (one trace, the client's when it sends a W3C ``traceparent``)::

    POST /v1/completions     SERVER, the HTTP side (ingress, or the engine replica in the
      │                      direct layout): response id, x-request-id, model, prompt tokens
      ├─ route               the request router's decision (routed layout): chosen replica,
      │                      reason, predicted hit tokens; one per ranking Serve asks for
      └─ engine_replica      the engine replica's part of one prompt: replica id, tokens
           ├─ engine.queue     arrival at the replica -> first scheduled    (per choice)
           ├─ engine.prefill   first scheduled -> first token
           └─ engine.decode    first token -> last token

The engine phases are made after the fact from the engine's own ``time.monotonic()`` stamps
(``engine.outputs.RequestDelta``), so the engine thread never makes a tracing call. Across
processes the context travels as a W3C carrier in ``EngineRequest.trace_context``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from deployments.engine_request import EngineError, EngineRequest, StreamItem
    from deployments.validation import GenerationJob
    from deployments.vllm_metrics import ChoiceTimer
    from engine.outputs import RequestDelta

SERVICE_NAME = "prefixserve"
TRACER_NAME = "prefixserve"
# A carrier: W3C trace context headers (``traceparent``, ``tracestate``) by name.
Carrier = dict[str, str]

_lock = threading.Lock()
# The process's tracer once ``setup`` (or ``use_tracer``) made one; None: tracing is off here.
_tracer: Tracer | None = None


def enabled(endpoint: str | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a process configured with ``endpoint`` (``AppArgs.otlp_traces_endpoint``) traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(endpoint: str | None) -> Tracer | None:
    """The process's tracer when tracing is on (made, with its OTLP exporter, on the first call);
    None when it is off. Raises ImportError naming the extra when the SDK is missing."""
    global _tracer
    if not enabled(endpoint):
        return None
    with _lock:
        if _tracer is None:
            _tracer = _make_tracer(endpoint)
        return _tracer


def use_tracer(tracer: Tracer | None) -> None:
    """Make ``tracer`` the process's (an in-memory exporter's, in tests); None forgets it."""
    global _tracer
    with _lock:
        _tracer = tracer


def active() -> Tracer | None:
    """The process's tracer, if ``setup`` turned tracing on here (the request router's view)."""
    return _tracer


def _make_tracer(endpoint: str | None) -> Tracer:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ImportError("tracing needs OpenTelemetry: pip install 'prefixserve[tracing]'") from e
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    # The sampler and the resource's other attributes come from OTEL_* variables.
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    return provider.get_tracer(TRACER_NAME)


def _exporter(endpoint: str | None) -> Any:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    try:
        if protocol.strip().lower() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ImportError(
            f"tracing needs an OTLP exporter ({protocol or 'http/protobuf'}): "
            "pip install 'prefixserve[tracing]'"
        ) from e
    # None: the exporter reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or _ENDPOINT) itself.
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def _wall_ns(monotonic_s: float, now_ns: int, now_monotonic_s: float) -> int:
    """A ``time.monotonic()`` stamp of this process as wall-clock nanoseconds."""
    return now_ns - round((now_monotonic_s - monotonic_s) * 1e9)


# -- the HTTP side -----------------------------------------------------------------------------


def http_span(tracer: Tracer, method: str, path: str, headers: Mapping[str, str]) -> Span:
    """The request's SERVER span, a child of the client's ``traceparent`` when it sent one."""
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    return tracer.start_span(
        f"{method} {path}",
        context=propagate.extract(headers),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path},
    )


def describe_job(
    span: Span, job: GenerationJob, model: str, x_request_id: str | None, replica_id: str
) -> None:
    """What the HTTP span says about the validated request."""
    span.set_attributes(
        {
            "gen_ai.response.id": job.builder.id,
            "gen_ai.request.model": model,
            "gen_ai.usage.prompt_tokens": sum(len(p) for p in job.prompts),
            "gen_ai.request.max_tokens": job.params.max_tokens or 0,
            "gen_ai.request.n": job.n,
            "prefixserve.prompts": len(job.prompts),
            "prefixserve.stream": job.stream,
            "prefixserve.http_replica_id": replica_id,
        }
    )
    if x_request_id:
        span.set_attribute("http.request.header.x-request-id", [x_request_id])


async def traced_response(span: Span, response: Awaitable[Any]) -> Any:
    """Await ``response`` (a route's answer) with ``span`` current, so that engine requests
    carry it; the span ends with the response, for a stream when its body has been sent."""
    from opentelemetry import trace
    from opentelemetry.trace import StatusCode

    try:
        with trace.use_span(
            span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            answer = await response
    except Exception as e:
        # An HTTPError is the answer (4xx are the client's: no error status on a SERVER span).
        status = getattr(e, "status", 500)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(StatusCode.ERROR, str(e))
        span.end()
        raise
    except BaseException:
        span.set_attribute("prefixserve.cancelled", True)  # the client went away
        span.end()
        raise
    span.set_attribute("http.response.status_code", answer.status_code)
    iterator = getattr(answer, "body_iterator", None)
    if iterator is None:
        span.end()
    else:
        answer.body_iterator = _SpanEndingBody(iterator, span)
    return answer


class _SpanEndingBody:
    """A streamed body that ends its span when it has been sent, closed or collected."""

    def __init__(self, body: AsyncIterator[bytes], span: Span) -> None:
        self.body = body
        self.span = span
        self._ended = False

    def __aiter__(self) -> _SpanEndingBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.body.__anext__()
        except BaseException:
            self._end()
            raise

    async def aclose(self) -> None:
        try:
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.span.end()

    def __del__(self) -> None:
        self._end()


def current_carrier() -> Carrier | None:
    """The current span's context as W3C headers, for an engine request; None without one."""
    from opentelemetry import propagate

    carrier: Carrier = {}
    propagate.inject(carrier)
    return carrier or None


# -- the request router -----------------------------------------------------------------------


def record_routing(
    tracer: Tracer, carrier: Mapping[str, str], start_ns: int, attributes: Mapping[str, Any]
) -> None:
    """One routing decision as a span under the request's (from its ``carrier``)."""
    from opentelemetry import propagate

    span = tracer.start_span(
        "route", context=propagate.extract(carrier), start_time=start_ns, attributes=attributes
    )
    span.end()


# -- the engine replica -----------------------------------------------------------------------


class ReplicaTrace:
    """The ``engine_replica`` span of one engine request and its phases' spans.

    Invariant: ``end`` runs once, after every ``choice`` call; the span's children are made
    with explicit times, so nothing here runs on the engine thread."""

    def __init__(self, tracer: Tracer, req: EngineRequest, replica_id: str) -> None:
        from opentelemetry import propagate
        from opentelemetry.trace import set_span_in_context

        self.tracer = tracer
        self.span = tracer.start_span(
            "engine_replica",
            context=propagate.extract(req.trace_context or {}),
            attributes={
                "prefixserve.replica_id": replica_id,
                "gen_ai.request.id": req.request_id,
                "gen_ai.usage.prompt_tokens": len(req.prompt_token_ids),
                "gen_ai.request.n": req.n,
            },
        )
        self.context = set_span_in_context(self.span)
        self.completion_tokens = 0
        self.cached_tokens = 0

    def observe(self, item: StreamItem | EngineError) -> None:
        """Each item the replica sends: an error marks the span."""
        from opentelemetry.trace import StatusCode

        if hasattr(item, "status"):
            self.span.set_attributes({"error.type": item.type, "prefixserve.status": item.status})
            self.span.set_status(StatusCode.ERROR, item.message)

    def choice(self, index: int, timer: ChoiceTimer, delta: RequestDelta) -> None:
        """A finished choice's queue, prefill and decode spans (``delta``: its final delta)."""
        now_ns, now = time.time_ns(), time.monotonic()
        self.completion_tokens += delta.num_output_tokens
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        stamps = [timer.arrival, delta.scheduled_time, delta.first_token_time, timer.last_at]
        phases = (
            ("engine.queue", {}),
            (
                "engine.prefill",
                {
                    "gen_ai.usage.prompt_tokens": delta.num_prompt_tokens,
                    "prefixserve.cached_tokens": delta.num_cached_tokens,
                    "prefixserve.remote_cached_tokens": delta.num_remote_cached_tokens,
                },
            ),
            (
                "engine.decode",
                {
                    "gen_ai.usage.completion_tokens": delta.num_output_tokens,
                    "gen_ai.response.finish_reasons": [delta.finish_reason or ""],
                },
            ),
        )
        for (name, attributes), start, end in zip(phases, stamps[:-1], stamps[1:], strict=True):
            if start is None or end is None:
                continue  # never scheduled, or no token: the phase did not happen
            span = self.tracer.start_span(
                name,
                context=self.context,
                start_time=_wall_ns(start, now_ns, now),
                attributes={"prefixserve.choice": index, **attributes},
            )
            span.end(end_time=_wall_ns(max(start, end), now_ns, now))

    def end(self) -> None:
        self.span.set_attributes(
            {
                "gen_ai.usage.completion_tokens": self.completion_tokens,
                "prefixserve.cached_tokens": self.cached_tokens,
            }
        )
        self.span.end()
