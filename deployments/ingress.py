"""The HTTP ingress: OpenAI-compatible routes in front of the engine deployment.

It validates and tokenizes each request once, computes the prompt's chained block hashes (the
request router on the engine handle reads them), and relays the engine's stream as SSE. Every
error leaves as OpenAI-style JSON; nothing a client sends can crash it.

Overload and faults:
* at most ``limits.max_ongoing_per_ingress`` requests are in flight through one ingress replica
  (a stream counts until it ends); beyond it, and when the engine handle's queue or an engine
  replica is full, the answer is 429 with ``Retry-After``;
* a request whose engine replica fails or is full before anything reached the client (the replica
  died, it refused with 429, or its engine had died before the request got there) is retried on
  another replica, up to ``MAX_ATTEMPTS`` in all; a non-streamed request is retried even after
  tokens were produced, since none were sent. A stream that already started ends with an SSE
  error event instead. A request that was running when its engine loop died is not retried (it
  may be what broke it): it gets a 503.
"""

import asyncio
import dataclasses
import hmac
import json
import logging
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from deployments.choices import merge_streams
from deployments.config import AppArgs
from deployments.engine_request import EngineRequest
from deployments.metrics import render
from deployments.openai_format import Echo, ResponseBuilder, error_body, sse
from deployments.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from engine.block_hash import compute_block_hashes
from engine.model.config import model_config_from_hf
from engine.model.loader import load_hf_config, load_tokenizer, resolve_model
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers


def error_response(e: HTTPError) -> JSONResponse:
    return JSONResponse(
        error_body(str(e), e.type, e.param, e.code), status_code=e.status, headers=e.headers
    )


@app.exception_handler(HTTPError)
async def _http_error(_: Request, e: HTTPError) -> JSONResponse:
    return error_response(e)


@app.exception_handler(StarletteHTTPException)
async def _starlette_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), type_, code=str(e.status_code)), e.status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(str(e)), status_code=400)


@app.exception_handler(Exception)
async def _unexpected_error(_: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error in the ingress")
    return JSONResponse(
        error_body(f"internal error: {type(e).__name__}", "internal_error"), status_code=500
    )


# Attempts per request when its engine replica fails before anything reached the client.
MAX_ATTEMPTS = 3
RETRY_BACKOFF_S = 0.1
# Serve replica states of a replica that is not serving yet (``ReplicaState`` values).
STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING")
# How long the end of an engine stream may lag its final item.
READ_TO_END_TIMEOUT_S = 5.0


class _RetryableError(Exception):
    """An engine replica failed, or was full, before the client saw anything: try another
    replica (after a pause when it failed). ``error`` is the answer if no attempt is left."""

    def __init__(self, error: "HTTPError", backoff: bool = True) -> None:
        super().__init__(str(error))
        self.error = error
        self.backoff = backoff


REJECT_QUEUES = ("ingress", "engine_queue", "engine_replica")


class IngressMetrics:
    """Admission figures of one ingress replica, appended to ``/metrics``."""

    def __init__(self, ingress_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, {"ingress": ingress_id}
        self.in_flight = Gauge(
            "prefixserve_ingress_requests_in_flight",
            "Generation requests in flight through the ingress replica (streams until they end).",
            ["ingress"],
            registry=r,
        ).labels(**labels)
        self.in_flight_peak = Gauge(
            "prefixserve_ingress_requests_in_flight_peak",
            "Most generation requests in flight through the ingress replica at once.",
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


class _Lease:
    """A request's slot in the ingress's in-flight count and its engine streams (one per
    prompt).

    ``release`` is idempotent and runs exactly once in effect: from the route when the response
    is complete, else from the SSE generator's ``finally`` or the streaming response's own
    ``finally`` (which also covers a client gone before the generator started), or at worst when
    the response object is collected. A stream that has not delivered its final item is
    cancelled, so the engine aborts the request and frees its blocks."""

    def __init__(self, ingress: "Ingress", num_streams: int = 1) -> None:
        self.ingress = ingress
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
        self.ingress.set_in_flight(self.ingress.inflight - 1)


class _LeasedStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], lease: _Lease, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.lease = lease
        weakref.finalize(self, lease.release)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.lease.release()


async def _read_to_end(stream: Any) -> None:
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


async def _gather(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
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


def _own_serve_request_id(suffix: str) -> None:
    """Give the current task's handle calls an internal request id of their own.

    Every handle call made while serving one HTTP request inherits that request's internal id,
    and Serve's request router matches routing results to pending calls by it: calls in flight
    together under one id get mixed up, and all but one are never routed. Each prompt of a
    several-prompt request runs in a task of its own, whose copy of the context this changes."""
    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(
        dataclasses.replace(
            current,
            _internal_request_id=f"{current._internal_request_id or uuid.uuid4().hex}-{suffix}",
        )
    )


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


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    where = ".".join(str(x) for x in err.get("loc", ()))
    return (f"{where}: {err.get('msg')}" if where else str(err.get("msg"))), param


def _replica_header(items: list[dict[str, Any]]) -> dict[str, str]:
    """Which engine replica served the request (several, comma-separated, for several prompts)."""
    return {"x-engine-replica": ",".join(dict.fromkeys(i["replica_id"] for i in items))}


def _item_error(item: dict[str, Any], retry_after: dict[str, str]) -> HTTPError:
    err = item["error"]
    headers = retry_after if err["status"] in (429, 503) else None
    return HTTPError(
        err["status"], err["message"], err["type"], code=err.get("code"), headers=headers
    )


# Everything the class below uses must be defined above it: ``serve.ingress`` copies the class
# when it is decorated, with the module's globals as they are at that point.
@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = engine
        self.generate_handle = engine.options(
            method_name="generate",
            stream=True,
            _by_reference=self.args.handle_transport == "actor",
        )
        model_dir = resolve_model(self.args.model)
        hf_config, generation_config = load_hf_config(model_dir)
        model_cfg = model_config_from_hf(hf_config, generation_config)
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = self.args.engine.max_model_len or model_cfg.max_position_embeddings
        self.tokenizer = load_tokenizer(self.args.tokenizer or model_dir)
        self.block_size = self.args.engine.block_size
        # Must equal the engine's salt (EngineConfig.hash_salt defaults to the model name).
        self.hash_salt = self.args.model
        self.model_name = self.args.model_name
        self.api_key = self.args.resolved_api_key()
        self.retry_after = {"Retry-After": str(self.args.limits.retry_after_s)}
        self.inflight = 0
        self.ingress_metrics = IngressMetrics(serve.get_replica_context().replica_id.unique_id)

    def set_in_flight(self, n: int) -> None:
        self.inflight = n
        self.ingress_metrics.set_in_flight(n)

    # -- guards ----------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
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

    def _overloaded(self, what: str, queue: str) -> HTTPError:
        self.ingress_metrics.rejected[queue].inc()
        return HTTPError(
            429,
            f"server overloaded: {what}; retry later",
            "overloaded_error",
            code="overloaded",
            headers=self.retry_after,
        )

    def _check_capacity(self) -> None:
        """Cheap early refusal, before the body is read or tokenized."""
        limit = self.args.limits.max_ongoing_per_ingress
        if self.inflight >= limit:
            raise self._overloaded(f"{self.inflight} requests in flight (limit {limit})", "ingress")

    async def _read_json(self, request: Request) -> Any:
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
        try:
            return json.loads(body)
        # ValueError covers integers too long to convert; RecursionError, deep nesting.
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"body is not valid JSON: {e}") from e

    def _parse(self, model: type[BaseModel], body: Any) -> Any:
        if not isinstance(body, dict):
            raise HTTPError(400, "body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise HTTPError(400, message, param=param) from e

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise HTTPError(
                400,
                f"model: {name!r} is not served here (serving {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise HTTPError(
                    400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt"
                )
            return prompt
        if self.tokenizer is None:
            raise HTTPError(
                400, "prompt: this model has no tokenizer; send token ids", param="prompt"
            )
        try:
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates: the client's input
            raise HTTPError(400, f"prompt: cannot be tokenized: {e}", param="prompt") from e

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def _chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise HTTPError(
                400,
                "messages: this model has no chat template; use /v1/completions",
                param="messages",
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                req.conversation(),
                add_generation_prompt=req.add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as e:  # noqa: BLE001 - template errors are the client's input
            raise HTTPError(400, f"messages: chat template failed: {e}", param="messages") from e
        return list(ids)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise HTTPError(
                400, f"logit_bias: token ids must be in [0, {self.vocab_size})", param="logit_bias"
            )

    def _check_lengths(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        if not prompt_ids:
            raise HTTPError(400, "prompt: must not be empty", param="prompt")
        limit = self.args.limits.max_prompt_tokens
        if limit and len(prompt_ids) > limit:
            raise HTTPError(
                400, f"prompt: {len(prompt_ids)} tokens exceed the limit of {limit}", param="prompt"
            )
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(prompt_ids)} and {param} asks for {max_tokens} more.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens > self.args.limits.max_tokens:
            raise HTTPError(
                400, f"{param}: must be at most {self.args.limits.max_tokens}", param=param
            )

    # -- routes ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        self._check_auth(request)
        self._check_capacity()
        req = self._parse(CompletionRequest, await self._read_json(request))
        self._check_model(req.model)
        try:
            prompts = req.prompts()
            # OpenAI's default for completions, within the configured limit.
            params = req.to_sampling_params(default_max_tokens=min(16, self.args.limits.max_tokens))
        except ProtocolError as e:
            raise HTTPError(400, str(e), param=e.param) from e
        prompt_ids = [self._tokenize(p) for p in prompts]
        for ids in prompt_ids:
            self._check_lengths(ids, params.max_tokens, "max_tokens")
        self._check_logit_bias(params)
        echo = None
        if req.echo:
            echo = [
                Echo(p if isinstance(p, str) else self._decode(ids), ids)
                for p, ids in zip(prompts, prompt_ids, strict=True)
            ]
        builder = ResponseBuilder(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            self.model_name,
            self.tokenizer,
            req.n,
            num_prompts=len(prompts),
            echo=echo,
            echo_only=req.echo_only,
        )
        return await self._generate(req, prompt_ids, params, builder)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._check_auth(request)
        self._check_capacity()
        req = self._parse(ChatCompletionRequest, await self._read_json(request))
        self._check_model(req.model)
        prompt_ids = self._chat_tokens(req)
        # Chat defaults to "until the context is full", capped by the configured limit.
        default_max = max(1, min(self.args.limits.max_tokens, self.max_model_len - len(prompt_ids)))
        try:
            params = req.to_sampling_params(default_max_tokens=default_max)
        except ProtocolError as e:
            raise HTTPError(400, str(e), param=e.param) from e
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self._check_lengths(prompt_ids, params.max_tokens, param)
        self._check_logit_bias(params)
        builder = ResponseBuilder(
            "chat", f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer, req.n
        )
        return await self._generate(req, [prompt_ids], params, builder)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._check_auth(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "prefixserve",
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            reports = await asyncio.wait_for(self.engine.cluster_report.remote(), timeout=5.0)
            status = await asyncio.to_thread(serve.status)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot serve"
            return JSONResponse({"status": "unavailable", "reason": repr(e)}, status_code=503)
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

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._check_auth(request)
        try:
            reports = await asyncio.wait_for(self.engine.cluster_report.remote(), timeout=10.0)
        except Exception as e:  # noqa: BLE001
            raise HTTPError(503, f"metrics unavailable: {e!r}", "service_unavailable") from e
        text = render(r["metrics"] for r in reports.values()) + self.ingress_metrics.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # -- generation ------------------------------------------------------------------------------
    async def _generate(
        self, req: Any, prompts: list[list[int]], params: Any, builder: ResponseBuilder
    ) -> Response:
        """One engine request per prompt, each routed on its own (by its own prefix), their
        items merged into one response."""
        self._check_capacity()  # again: the body was read since, other requests came in
        engine_reqs = [
            EngineRequest(
                request_id=builder.id if len(prompts) == 1 else f"{builder.id}-{i}",
                prompt_token_ids=ids,
                sampling=dataclasses.asdict(params),
                block_hashes=compute_block_hashes(ids, self.block_size, self.hash_salt),
                priority=req.priority,
                timeout_s=self.args.limits.request_timeout_s,
                stream=bool(req.stream),
                n=req.n,
            )
            for i, ids in enumerate(prompts)
        ]
        # No await between the check above and this count: admission is atomic.
        self.set_in_flight(self.inflight + 1)
        lease = _Lease(self, len(engine_reqs))
        handed_off = False
        try:
            if req.stream:
                firsts = await _gather(
                    [self._open(lease, i, r, req.n) for i, r in enumerate(engine_reqs)]
                )
                handed_off = True
                return _LeasedStreamingResponse(
                    self._sse(lease, firsts, builder, req.include_usage),
                    lease,
                    media_type="text/event-stream",
                    headers=_replica_header(firsts),
                )
            results = await _gather(
                [self._complete(lease, i, r, req.n) for i, r in enumerate(engine_reqs)]
            )
            items = [item for its in results for item in its]
            return JSONResponse(builder.full(items), headers=_replica_header(items))
        finally:
            if not handed_off:
                lease.release()

    async def _retry_pause(self, e: "_RetryableError", attempt: int) -> None:
        """Before attempt ``attempt + 1``; raises the error once the attempts are used up."""
        logger.warning("engine attempt %d failed: %s", attempt, e)
        if attempt >= MAX_ATTEMPTS:
            raise e.error from e
        self.ingress_metrics.retries.inc()
        if e.backoff:
            await asyncio.sleep(RETRY_BACKOFF_S * attempt)

    async def _attempt(
        self,
        lease: _Lease,
        i: int,
        engine_req: EngineRequest,
        n: int,
        read: Callable[[Any, int], Awaitable[T]],
    ) -> T:
        """``read(stream, index offset)`` on prompt ``i``'s stream, on another replica again while
        it fails in a way another replica may not."""
        if len(lease.streams) > 1:
            _own_serve_request_id(str(i))
        attempt = 1
        while True:
            stream = lease.streams[i] = self.generate_handle.remote(engine_req)
            try:
                return await read(stream, i * n)
            except _RetryableError as e:
                stream.cancel()
                await self._retry_pause(e, attempt)
                attempt += 1

    async def _open(self, lease: _Lease, i: int, engine_req: EngineRequest, n: int) -> dict:
        """Start prompt ``i``'s stream: its first item."""
        return await self._attempt(lease, i, engine_req, n, self._next_item)

    async def _complete(
        self, lease: _Lease, i: int, engine_req: EngineRequest, n: int
    ) -> list[dict[str, Any]]:
        """Prompt ``i``'s every item; retried as a whole, since nothing was sent yet."""
        items = await self._attempt(lease, i, engine_req, n, self._collect)
        lease.ended[i] = True
        await _read_to_end(lease.streams[i])
        return items

    async def _collect(self, stream: Any, offset: int) -> list[dict[str, Any]]:
        items = [await self._next_item(stream, offset)]
        while not items[-1]["done"]:
            items.append(await self._next_item(stream, offset))
        return items

    async def _next_item(self, stream: Any, offset: int = 0) -> dict[str, Any]:
        """The stream's next item, its choice index moved up by ``offset`` (the prompt's first
        choice); an engine failure becomes ``HTTPError`` or, when another replica may succeed,
        ``_RetryableError``."""
        try:
            item = await stream.__anext__()
        except StopAsyncIteration as e:
            raise _RetryableError(self._unavailable("engine stream ended early")) from e
        except BackPressureError as e:
            raise self._overloaded("engine queue is full", "engine_queue") from e
        except RayActorError as e:
            # The replica died (or is unreachable): Serve routes the retry elsewhere.
            raise _RetryableError(self._unavailable(f"engine replica failed: {e!r}")) from e
        except Exception as e:
            logger.warning("engine call failed: %r", e)
            raise self._unavailable(f"engine unavailable: {type(e).__name__}") from e
        if "error" in item:
            err = item["error"]
            if err.get("code") == "engine_dead":  # never reached a working engine
                raise _RetryableError(self._unavailable(err["message"]))
            if err["status"] == 429:
                # The router's view of replica load lags; another replica may have room.
                self.ingress_metrics.rejected["engine_replica"].inc()
                raise _RetryableError(_item_error(item, self.retry_after), backoff=False)
            raise _item_error(item, self.retry_after)
        item["index"] = item.get("index", 0) + offset
        return item

    def _unavailable(self, message: str) -> HTTPError:
        return HTTPError(
            503, message, "service_unavailable", code="engine_unavailable", headers=self.retry_after
        )

    async def _sse(
        self,
        lease: _Lease,
        firsts: list[dict[str, Any]],
        builder: ResponseBuilder,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        async def prompt_items(i: int) -> AsyncIterator[dict[str, Any]]:
            item = firsts[i]
            while True:
                yield item
                if item["done"]:
                    lease.ended[i] = True
                    return
                item = await self._next_item(lease.streams[i], i * builder.n)

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
            except (HTTPError, _RetryableError) as e:
                # Tokens already went out: the stream ends with an error event.
                err = e.error if isinstance(e, _RetryableError) else e
                logger.warning("engine stream failed: %s", err)
                yield sse(error_body(str(err), err.type, err.param, err.code))
            finally:
                await merged.aclose()
            yield b"data: [DONE]\n\n"
            for stream, ended in zip(lease.streams, lease.ended, strict=True):
                if ended:
                    await _read_to_end(stream)
        finally:
            lease.release()
