"""The HTTP ingress: OpenAI-compatible routes in front of the engine deployment.

It validates and tokenizes each request once, computes the prompt's chained block hashes (the
request router on the engine handle reads them), and relays the engine's stream as SSE. Every
error leaves as OpenAI-style JSON; nothing a client sends can crash it.
"""

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import AppArgs
from deployments.engine_request import EngineRequest
from deployments.metrics import render
from deployments.openai_format import ResponseBuilder, error_body, sse
from deployments.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from engine.block_hash import compute_block_hashes
from engine.model.config import model_config_from_hf
from engine.model.loader import load_hf_config, load_tokenizer, resolve_model

logger = logging.getLogger("ray.serve")

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


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    where = ".".join(str(x) for x in err.get("loc", ()))
    return (f"{where}: {err.get('msg')}" if where else str(err.get("msg"))), param


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = engine
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
        self.inflight = 0

    # -- guards ----------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise HTTPError(
                401, "missing or invalid API key", "authentication_error", code="invalid_api_key"
            )

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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

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
        req = self._parse(CompletionRequest, await self._read_json(request))
        self._check_model(req.model)
        try:
            prompt_ids = self._tokenize(req.single_prompt())
            params = req.to_sampling_params(default_max_tokens=16)
        except ProtocolError as e:
            raise HTTPError(400, str(e), param=e.param) from e
        self._check_lengths(prompt_ids, params.max_tokens, "max_tokens")
        builder = ResponseBuilder(
            "completion", f"cmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer
        )
        return await self._generate(req, prompt_ids, params, builder)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._check_auth(request)
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
        builder = ResponseBuilder(
            "chat", f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer
        )
        return await self._generate(req, prompt_ids, params, builder)

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
        states = dict(engine_status.replica_states) if engine_status else {}
        running = states.get("RUNNING", 0)
        healthy = [rid for rid, r in reports.items() if r.get("healthy")]
        ok = (
            running > 0
            and len(healthy) >= running
            and all(r.get("healthy") for r in reports.values())
            and (engine_status is None or str(engine_status.status) != "UNHEALTHY")
        )
        body = {
            "status": "ok" if ok else "unavailable",
            "replicas": states,
            "healthy_replicas": sorted(healthy),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._check_auth(request)
        try:
            reports = await asyncio.wait_for(self.engine.cluster_report.remote(), timeout=10.0)
        except Exception as e:  # noqa: BLE001
            raise HTTPError(503, f"metrics unavailable: {e!r}", "service_unavailable") from e
        text = render(r["metrics"] for r in reports.values())
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # -- generation ------------------------------------------------------------------------------
    async def _generate(
        self, req: Any, prompt_ids: list[int], params: Any, builder: ResponseBuilder
    ) -> Response:
        if self.inflight >= self.args.limits.max_ongoing_per_ingress:
            raise HTTPError(
                429,
                "server overloaded: too many requests in flight",
                "overloaded_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        engine_req = EngineRequest(
            request_id=builder.id,
            prompt_token_ids=prompt_ids,
            sampling=dataclasses.asdict(params),
            block_hashes=compute_block_hashes(prompt_ids, self.block_size, self.hash_salt),
            priority=req.priority,
            timeout_s=self.args.limits.request_timeout_s,
        )
        self.inflight += 1
        stream = self.engine.options(stream=True).generate.remote(engine_req)
        handed_off = False
        try:
            first = await self._first_item(stream)
            headers = {"x-engine-replica": first["replica_id"]}
            if req.stream:
                handed_off = True
                return StreamingResponse(
                    self._sse(stream, first, builder, req.include_usage),
                    media_type="text/event-stream",
                    headers=headers,
                )
            items = [first]
            while not items[-1]["finished"]:
                item = await stream.__anext__()
                if "error" in item:
                    raise _item_error(item)
                items.append(item)
            return JSONResponse(builder.full(items), headers=headers)
        except StopAsyncIteration as e:
            raise HTTPError(500, "engine stream ended early", "engine_error") from e
        finally:
            if not handed_off:
                stream.cancel()
                self.inflight -= 1

    async def _first_item(self, stream: Any) -> dict[str, Any]:
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as e:
            name = type(e).__name__
            if "BackPressure" in name:
                raise HTTPError(
                    429,
                    "server overloaded: engine queue is full",
                    "overloaded_error",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                ) from e
            logger.warning("engine call failed: %r", e)
            raise HTTPError(
                503,
                f"engine unavailable: {name}",
                "service_unavailable",
                code="engine_unavailable",
                headers={"Retry-After": "1"},
            ) from e
        if "error" in first:
            raise _item_error(first)
        return first

    async def _sse(
        self, stream: Any, first: dict[str, Any], builder: ResponseBuilder, include_usage: bool
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            if builder.chat:
                yield sse(builder.role_chunk())
            item = first
            while True:
                if "error" in item:
                    err = item["error"]
                    yield sse(error_body(err["message"], err["type"], code=err.get("code")))
                    break
                if item["text"] or item["finished"] or item.get("logprobs"):
                    yield sse(builder.chunk(item))
                if item["finished"]:
                    finished = True
                    if include_usage:
                        yield sse(builder.usage_chunk(item))
                    break
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    yield sse(error_body("engine stream ended early", "engine_error"))
                    break
                except Exception as e:  # noqa: BLE001 - a dead replica ends the stream with an error
                    logger.warning("engine stream failed: %r", e)
                    yield sse(
                        error_body(
                            f"engine failed mid-stream: {type(e).__name__}",
                            "engine_error",
                            code="engine_unavailable",
                        )
                    )
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                stream.cancel()
            self.inflight -= 1


def _item_error(item: dict[str, Any]) -> HTTPError:
    err = item["error"]
    headers = {"Retry-After": "1"} if err["status"] in (429, 503) else None
    return HTTPError(
        err["status"], err["message"], err["type"], code=err.get("code"), headers=headers
    )
