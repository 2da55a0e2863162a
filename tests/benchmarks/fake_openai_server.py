"""A small fake OpenAI-compatible streaming server for testing the benchmark client.

It runs a real uvicorn server on 127.0.0.1 (a free port) in a background thread, so the client is
exercised over real sockets and real chunked streaming. Its behaviour depends on the order in
which requests arrive (``n``, counted from 0) and it logs exactly what it returned, so tests
derive their expectations from the log rather than from guesses:

- ``n % 6 == 4``: HTTP 429 with an OpenAI error body and ``Retry-After: 1``;
- ``n % 6 == 5``: a 200 stream that sends one token and then an error event;
- otherwise: ``max_tokens`` tokens in chunks of ``1 + n % 2`` tokens, then a usage chunk, then
  ``[DONE]``. ``cached_tokens`` is ``16 * (n % 3)`` capped at ``prompt_tokens - 1``.
- Every response carries ``x-engine-replica: r{n % 3 == 2}`` (uneven shares: r0 twice as often).
- The first content arrives after ``first_token_delay`` seconds, later ones ``token_delay`` apart;
  a request body may override both with ``fake_first_token_delay`` / ``fake_token_delay``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"


@dataclass
class FakeServer:
    first_token_delay: float = 0.02
    token_delay: float = 0.002
    log: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    _counter: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.log.clear()
            self.bodies.clear()
            self._counter = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, *, chat: bool) -> Response:
        body = await request.json()
        with self._lock:
            n = self._counter
            self._counter += 1
            self.bodies.append(body)
        replica = f"r{int(n % 3 == 2)}"
        headers = {"x-engine-replica": replica}
        if chat:
            prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        else:
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        entry: dict[str, Any] = {"n": n, "replica": replica, "prompt_tokens": prompt_tokens}
        self.log.append(entry)
        if n % 6 == 4:
            entry["outcome"] = "error"
            error = {
                "message": "engine overloaded",
                "type": "rate_limit",
                "param": None,
                "code": 429,
            }
            return JSONResponse({"error": error}, 429, headers={**headers, "Retry-After": "1"})
        first_delay = float(body.get("fake_first_token_delay", self.first_token_delay))
        delay = float(body.get("fake_token_delay", self.token_delay))
        stream = self._stream(n, body, chat, prompt_tokens, entry, first_delay, delay)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    async def _stream(
        self,
        n: int,
        body: dict[str, Any],
        chat: bool,
        prompt_tokens: int,
        entry: dict[str, Any],
        first_delay: float,
        delay: float,
    ) -> AsyncIterator[str]:
        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            payload = {"id": f"req-{n}", "model": MODEL, "choices": [choice], "usage": None}
            return f"data: {json.dumps(payload)}\n\n"

        if chat:  # OpenAI sends the role first, with no content: not a token
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            yield f"data: {json.dumps({'id': f'req-{n}', 'choices': [role]})}\n\n"
        yield ": keep-alive comment\n\n"
        await asyncio.sleep(first_delay)
        if n % 6 == 5:
            yield chunk("tok ")
            entry["outcome"] = "error"
            err = {"message": "replica died", "type": "internal_error", "param": None, "code": 500}
            yield f"data: {json.dumps({'error': err})}\n\n"
            return
        max_tokens = int(body["max_tokens"])
        per_chunk = 1 + n % 2
        chunks = 0
        for start in range(0, max_tokens, per_chunk):
            if chunks:
                await asyncio.sleep(delay)
            yield chunk("tok " * min(per_chunk, max_tokens - start))
            chunks += 1
        yield chunk(None, finish="length")
        cached = min(16 * (n % 3), prompt_tokens - 1)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        entry.update(outcome="ok", chunks=chunks, completion_tokens=max_tokens, cached=cached)
        yield f"data: {json.dumps({'id': f'req-{n}', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


class RunningFakeServer:
    """Context manager: serve a :class:`FakeServer` on a free port in a daemon thread."""

    def __init__(self, fake: FakeServer) -> None:
        self.fake = fake
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        fake.port = self._sock.getsockname()[1]
        config = uvicorn.Config(fake.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
