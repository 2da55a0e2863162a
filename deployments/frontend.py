"""The OpenAI-compatible HTTP routes, whichever deployment serves them.

``OpenAIFrontend`` holds everything a route needs (auth, body limits, the validator, admission,
generation on an ``EngineBackend``); ``openai_routes`` makes a FastAPI app and a mixin class whose
route methods delegate to ``self.frontend``. A deployment class inherits the mixin, sets
``self.frontend`` in its constructor and is decorated with ``serve.ingress(app)``. Each
deployment gets its own app: Serve rewrites an app's routes for the class it decorates.
"""

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from deployments.admission import CONTENT_TYPE_LATEST, Admission
from deployments.config import AppArgs
from deployments.generation import EngineBackend, Generation
from deployments.http_errors import HTTPError, install_error_handlers
from deployments.metrics import render
from deployments.validation import RequestValidator

logger = logging.getLogger("ray.serve")

# Serve replica states of a replica that is not serving yet (``ReplicaState`` values).
STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING")
HEALTH_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 10.0

Reports = Callable[[], Awaitable[dict[str, dict[str, Any]]]]


def _enum_value(x: Any) -> str:
    """A Serve status enum's value ("RUNNING"); ``str()`` of one is "ReplicaState.RUNNING"."""
    return str(getattr(x, "value", x))


def health_verdict(
    states: dict[str, int], reports: dict[str, dict[str, Any]], deployment_status: str | None
) -> tuple[bool, dict[str, Any]]:
    """Whether every engine replica can serve, and the body of ``/health``: ``states`` counts
    the Engine deployment's replicas by Serve state, ``reports`` are the replicas' own latest
    reports. A replica still starting cannot serve yet; answering 200 then would let a client's
    first burst land on the replicas that happen to be up, where it stays."""
    running = states.get("RUNNING", 0)
    healthy = [rid for rid, r in reports.items() if r.get("healthy")]
    ok = (
        running > 0
        and not any(states.get(s, 0) for s in STARTING_STATES)
        and len(healthy) >= running
        and all(r.get("healthy") for r in reports.values())
        and deployment_status != "UNHEALTHY"
    )
    return ok, {
        "status": "ok" if ok else "unavailable",
        "replicas": states,
        "healthy_replicas": sorted(healthy),
    }


class OpenAIFrontend:
    """``reports``: every engine replica's latest report (health and metrics)."""

    def __init__(
        self, args: AppArgs, backend: EngineBackend, replica_id: str, reports: Reports
    ) -> None:
        self.args = args
        self.validator = RequestValidator(args)
        self.admission = Admission(replica_id, args.limits.max_ongoing_per_ingress)
        self.generation = Generation(args, backend, self.admission)
        self.reports = reports
        self.api_key = args.resolved_api_key()

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
        limit = self.args.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise HTTPError(413, f"request body larger than {limit} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HTTPError(
                    413, f"request body larger than {limit} bytes", code="body_too_large"
                )
        return self.validator.parse_json(bytes(body))

    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        self.generation.check_capacity()
        job = self.validator.completion(await self.read_json(request))
        return await self.generation.run(job)

    async def chat_completions(self, request: Request) -> Response:
        self.check_auth(request)
        self.generation.check_capacity()
        job = self.validator.chat(await self.read_json(request))
        return await self.generation.run(job)

    def models(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        model = {
            "id": self.validator.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "prefixserve",
            "max_model_len": self.validator.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self) -> JSONResponse:
        try:
            reports = await asyncio.wait_for(self.reports(), timeout=HEALTH_TIMEOUT_S)
            status = await asyncio.to_thread(serve.status)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot serve"
            logger.warning("health check failed: %r", e)
            return JSONResponse(
                {"status": "unavailable", "reason": type(e).__name__}, status_code=503
            )
        app_status = status.applications.get(serve.get_replica_context().app_name)
        engine_status = app_status.deployments.get("Engine") if app_status else None
        ok, body = health_verdict(
            {_enum_value(k): n for k, n in engine_status.replica_states.items()}
            if engine_status
            else {},
            reports,
            _enum_value(engine_status.status) if engine_status else None,
        )
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        self.check_auth(request)
        try:
            reports = await asyncio.wait_for(self.reports(), timeout=METRICS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise HTTPError(
                503, f"metrics unavailable: {type(e).__name__}", "service_unavailable"
            ) from e
        text = render(r["metrics"] for r in reports.values()) + self.admission.metrics.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)


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

        @app.get("/health")
        async def health(self) -> JSONResponse:
            return await self.frontend.health()

        @app.get("/metrics")
        async def metrics(self, request: Request) -> Response:
            return await self.frontend.metrics(request)

    return app, OpenAIRoutes
