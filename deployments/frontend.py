"""The OpenAI-compatible HTTP routes, whichever deployment serves them.

``OpenAIFrontend`` holds everything a route needs (auth, body limits, the validator, admission,
generation on an ``EngineBackend``); ``openai_routes`` makes a FastAPI app and a mixin class whose
route methods delegate to ``self.frontend``. A deployment class inherits the mixin, sets
``self.frontend`` in its constructor and is decorated with ``serve.ingress(app)``. Each
deployment gets its own app: Serve rewrites an app's routes for the class it decorates.

Auth: with an API key set, every route requires it (``/health`` and ``/metrics`` too: they tell
who runs what where) except ``/ping``, the liveness route for probes.
"""

import asyncio
import concurrent.futures
import contextvars
import functools
import hmac
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deployments import request_logging, tracing
from deployments.admission import CONTENT_TYPE_LATEST, Admission
from deployments.config import AppArgs
from deployments.engine_backend import EngineBackend
from deployments.generation import Generation
from deployments.health import (
    CachedVerdict,
    EngineStatesCache,
    Reports,
    cluster_verdict,
    health_verdict,
)
from deployments.http_errors import HTTPError, install_error_handlers
from deployments.metrics import render
from deployments.validation import GenerationJob, RequestValidator, session_header, session_key

logger = logging.getLogger("ray.serve")

METRICS_TIMEOUT_S = 10.0
# Bodies above this size are parsed and tokenized in the worker pool rather than on the event loop
# (a hop costs ~0.1 ms; tokenizing a few KiB costs less than that).
OFFLOAD_BODY_BYTES = 16 << 10
T = TypeVar("T")


@functools.cache
def _validation_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's validation workers (created on first use, shared by every route)."""
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="prefixserve-validate")


# Re-exported: the verdict's rules are part of this module's contract.
__all__ = ["OpenAIFrontend", "health_verdict", "openai_routes"]


class OpenAIFrontend:
    """``reports``: every engine replica's latest report (health and metrics)."""

    def __init__(
        self,
        args: AppArgs,
        backend: EngineBackend,
        replica_id: str,
        reports: Reports,
        prefill: EngineBackend | None = None,
    ) -> None:
        self.args = args
        self.validator = RequestValidator(args)
        self.admission = Admission(replica_id, args.limits.max_ongoing_per_ingress)
        self.generation = Generation(args, backend, self.admission, prefill)
        self.reports = reports
        self.api_key = args.resolved_api_key()
        engine_states = EngineStatesCache()
        self.health_cache = CachedVerdict(lambda: cluster_verdict(reports, engine_states))
        self.replica_id = replica_id
        # None: tracing is off (nothing of OpenTelemetry is imported then).
        self.tracer = tracing.setup(args.otlp_traces_endpoint)

    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: the key must not leak through response timing.
        valid = hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        if scheme.lower() != "bearer" or not valid:
            raise HTTPError(
                401,
                "missing or invalid API key",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(self, request: Request) -> Any:
        return self.validator.parse_json(await self.read_body(request))

    async def read_body(self, request: Request) -> bytes:
        limit = self.args.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise HTTPError(413, f"request body larger than {limit} bytes", code="body_too_large")
        body = bytearray()
        timeout_s = self.args.limits.body_read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise HTTPError(
                            413, f"request body larger than {limit} bytes", code="body_too_large"
                        )
        except TimeoutError:
            raise HTTPError(
                408,
                f"request body not received within {timeout_s:g} s",
                "invalid_request_error",
                code="body_timeout",
            ) from None
        return bytes(body)

    async def validate(self, validate: Callable[[Any], T], body: bytes) -> T:
        """Parse and validate a body (chat template, tokenization): on the event loop when it is
        small, in the worker pool when it is not, so that one large request does not hold up the
        other requests' streams (the tokenizer releases the GIL; templates yield it)."""
        if len(body) <= OFFLOAD_BODY_BYTES:
            return validate(self.validator.parse_json(body))
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            _validation_pool(),
            context.run,
            lambda: validate(self.validator.parse_json(body)),
        )

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, self.validator.completion, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, self.validator.chat, "chat completion")

    async def _generate(
        self, request: Request, validate: Callable[[Any], GenerationJob], kind: str
    ) -> Response:
        request_logging.bind(x_request_id=_x_request_id(request))
        if self.tracer is None:
            return await self._run(request, validate, kind, None)
        span = tracing.http_span(self.tracer, request.method, request.url.path, request.headers)
        return await tracing.traced_response(span, self._run(request, validate, kind, span))

    async def _run(
        self,
        request: Request,
        validate: Callable[[Any], GenerationJob],
        kind: str,
        span: Any,
    ) -> Response:
        self.check_auth(request)
        self.generation.check_capacity()
        job = self._received(
            await self.validate(validate, await self.read_body(request)), kind, request
        )
        if span is not None:
            ids = request_logging.current()
            model = self.validator.model_name
            tracing.describe_job(span, job, model, ids.x_request_id, self.replica_id)
        return await self.generation.run(job)

    def _received(self, job: GenerationJob, kind: str, request: Request) -> GenerationJob:
        """Bind the response id for the request's log lines (and log the request if asked); the
        session header, when sent, names the request's session over the body's ``user``."""
        header = session_header(request.headers)
        if header:
            job.session_id = session_key(header, None)
        request_logging.bind(response_id=job.builder.id)
        if self.args.enable_log_requests:
            logger.info(
                "received %s request: prompts=%d prompt_tokens=%s n=%d max_tokens=%s stream=%s",
                kind,
                len(job.prompts),
                [len(p) for p in job.prompts],
                job.n,
                job.params.max_tokens,
                job.stream,
            )
        return job

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.validator.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "prefixserve",
            "max_model_len": self.validator.max_model_len,
        }

    def models(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    def model(self, request: Request, model_id: str) -> JSONResponse:
        """OpenAI's ``GET /v1/models/{model}``: the model's card, or 404."""
        self.check_auth(request)
        if model_id != self.validator.model_name:
            raise HTTPError(
                404,
                f"The model {model_id!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())

    def version(self, request: Request) -> JSONResponse:
        """vLLM's ``GET /version``: the serving package's installed version."""
        self.check_auth(request)
        return JSONResponse({"version": _package_version()})

    async def tokenize(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        body = await self.read_body(request)
        return JSONResponse(await self.validate(self.validator.tokenize, body))

    async def detokenize(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        return JSONResponse(self.validator.detokenize(await self.read_json(request)))

    async def health(self, request: Request) -> JSONResponse:
        """200 when every engine replica can serve, else 503; from the cached verdict."""
        self.check_auth(request)
        ok, body = await self.health_cache.get()
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        self.check_auth(request)
        try:
            reports = await asyncio.wait_for(self.reports(), timeout=METRICS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            logger.warning("metrics unavailable: %r", e)
            raise HTTPError(503, "metrics unavailable", "service_unavailable") from e
        text = render(r["metrics"] for r in reports.values()) + self.admission.metrics.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("prefixserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown"


def _x_request_id(request: Request) -> str | None:
    """The client's x-request-id, else the id Serve made up for the request (Serve answers it
    in the response's x-request-id header)."""
    given = request.headers.get("x-request-id")
    if given:
        return given
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # noqa: BLE001 - private API: a missing id only shortens log lines
        return None


def openai_routes() -> tuple[FastAPI, type]:
    """A fresh FastAPI app and a mixin class whose methods are its routes. (No postponed
    annotations in this module: FastAPI reads the route signatures' types.)"""
    app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    class OpenAIRoutes:
        frontend: "OpenAIFrontend"

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            return await self.frontend.completions(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request) -> Response:
            return await self.frontend.chat_completions(request)

        @app.get("/v1/models")
        async def models(self, request: Request) -> JSONResponse:
            return self.frontend.models(request)

        @app.get("/v1/models/{model_id:path}")
        async def model(self, request: Request, model_id: str) -> JSONResponse:
            return self.frontend.model(request, model_id)

        @app.get("/version")
        async def version(self, request: Request) -> JSONResponse:
            return self.frontend.version(request)

        @app.post("/tokenize")
        async def tokenize(self, request: Request) -> JSONResponse:
            return await self.frontend.tokenize(request)

        @app.post("/detokenize")
        async def detokenize(self, request: Request) -> JSONResponse:
            return await self.frontend.detokenize(request)

        @app.get("/health")
        async def health(self, request: Request) -> JSONResponse:
            return await self.frontend.health(request)

        @app.get("/metrics")
        async def metrics(self, request: Request) -> Response:
            return await self.frontend.metrics(request)

    # Liveness for probes: open even with an API key (a kubelet's probe carries no header),
    # and answered by this process alone, with no call to any other actor, so that a slow
    # registry or a replica starting elsewhere never fails it; whether the application can
    # serve is /health's job (readiness). Named /ping because vLLM serves its unauthenticated
    # liveness check there (GET, and POST as SageMaker's probes send it), so probes written for
    # a vLLM server work here unchanged.
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:
        return JSONResponse({"status": "alive"})

    return app, OpenAIRoutes
