"""One streaming request to an OpenAI-compatible server, timed on the client.

Works against any server that speaks the OpenAI completions / chat completions streaming protocol
(SSE ``data: {...}`` chunks ending with ``data: [DONE]``). Timing is taken from
``time.perf_counter`` at the arrival of each SSE event's first line; see ``benchmarks.metrics`` for
the definitions of the reported metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from benchmarks.metrics import RequestResult
from benchmarks.sse import SSEDecoder, SSEEvent
from benchmarks.workloads import WorkloadRequest

Endpoint = Literal["completions", "chat"]
PromptFormat = Literal["ids", "text"]
Renderer = Callable[[Sequence[int]], str]
REPLICA_HEADER = "x-engine-replica"
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ClientConfig:
    """How to turn a workload request into an HTTP request.

    ``base_url`` is the server root (a trailing ``/v1`` is accepted and ignored). ``prompt_format``
    applies to the completions endpoint only; chat messages are always text.
    """

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    prompt_format: PromptFormat = "ids"
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 600.0

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return server_root(self.base_url) + path


def server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# --- prompt text -------------------------------------------------------------------------------

_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"


def synthetic_word(token_id: int) -> str:
    """A pronounceable word that stands for ``token_id`` (one consonant-vowel syllable per base-85
    digit). Equal ids give equal words, so shared token prefixes stay shared as text."""
    base = len(_CONSONANTS) * len(_VOWELS)
    syllables = []
    n = token_id
    while True:
        n, digit = divmod(n, base)
        syllables.append(_CONSONANTS[digit // len(_VOWELS)] + _VOWELS[digit % len(_VOWELS)])
        if n == 0:
            return "".join(reversed(syllables))


def synthetic_text(token_ids: Sequence[int]) -> str:
    """Text for servers that need it when no tokenizer is available. Its token count under a real
    tokenizer is only roughly proportional to ``len(token_ids)``; the server's usage is exact."""
    return " ".join(synthetic_word(t) for t in token_ids)


def tokenizer_renderer(name_or_path: str) -> Renderer:
    """Decode token ids with a Hugging Face tokenizer (a directory, or a model name this project's
    loader can resolve)."""
    from transformers import AutoTokenizer

    path: str | Path = name_or_path
    if not Path(name_or_path).exists():
        try:
            from engine.model.loader import resolve_model

            path = resolve_model(name_or_path)
        except Exception:  # not this project's model name: let transformers resolve it
            path = name_or_path
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return lambda ids: tokenizer.decode(list(ids))


# --- requests ----------------------------------------------------------------------------------


def build_payload(
    request: WorkloadRequest, config: ClientConfig, render: Renderer = synthetic_text
) -> dict[str, Any]:
    """The JSON body for ``request``: streaming with usage, exact ``max_tokens``, the configured
    temperature, ``ignore_eos`` only when asked for (it is an extension), then ``extra_body``."""
    body: dict[str, Any] = {"model": config.model}
    ids = request.prompt_token_ids
    if config.endpoint == "chat":
        split = request.shared_prefix_len
        messages = [{"role": "system", "content": render(ids[:split])}] if split else []
        messages.append({"role": "user", "content": render(ids[split:])})
        body["messages"] = messages
    else:
        body["prompt"] = list(ids) if config.prompt_format == "ids" else render(ids)
    body.update(
        max_tokens=request.output_len,
        temperature=config.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def _chunk_content(chunk: dict[str, Any], endpoint: Endpoint) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def error_text(status_code: int, body: bytes, headers: httpx.Headers | None = None) -> str:
    """``HTTP <code>: <message>`` from an OpenAI-style error body (or the raw body)."""
    message = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(message)
        error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(error, dict):
            message = str(error.get("message") or error.get("detail") or error)
        elif isinstance(error, str):
            message = error
    except ValueError:
        pass
    text = f"HTTP {status_code}: {message}"
    if headers is not None and "retry-after" in headers:
        text += f" (Retry-After: {headers['retry-after']})"
    return text[:_MAX_ERROR_CHARS]


def _apply_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    result.cached_tokens = int(cached) if cached is not None else None


async def stream_request(
    client: httpx.AsyncClient,
    config: ClientConfig,
    request: WorkloadRequest,
    result: RequestResult,
    render: Renderer = synthetic_text,
) -> None:
    """Send ``request`` and fill ``result`` as the stream arrives.

    On return ``result.outcome`` is ``ok`` or ``error`` (with ``result.error``); if the task is
    cancelled it is left as the caller set it. ``result.send_time`` is not touched: latencies are
    measured from this call's own clock reading just before the request goes out.
    """
    body = build_payload(request, config, render)
    headers = auth_headers(config.api_key)
    result.prompt_len = request.prompt_len
    result.output_len = request.output_len
    text_parts: list[str] = []
    start = time.perf_counter()
    try:
        async with (
            asyncio.timeout(config.request_timeout),
            client.stream("POST", config.url, json=body, headers=headers) as response,
        ):
            result.status_code = response.status_code
            result.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                raw = await response.aread()
                result.outcome = "error"
                result.error = error_text(response.status_code, raw, response.headers)
                return
            done = False
            last_content_time: float | None = None
            decoder = SSEDecoder()

            def handle(event: SSEEvent) -> bool:
                """Process one event; True when the stream is over."""
                nonlocal last_content_time
                if event.data.strip() == "[DONE]":
                    return True
                chunk = json.loads(event.data)
                if "error" in chunk:
                    err = chunk["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    raise _StreamError(f"stream error: {message}")
                if chunk.get("usage"):
                    _apply_usage(result, chunk["usage"])
                content = _chunk_content(chunk, config.endpoint)
                if content:
                    now = event.time if event.time is not None else time.perf_counter()
                    if last_content_time is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last_content_time)
                    last_content_time = now
                    result.num_chunks += 1
                    text_parts.append(content)
                return False

            async for line in response.aiter_lines():
                event = decoder.feed_line(line, time.perf_counter())
                if event is not None and handle(event):
                    done = True
                    break
            if not done and (event := decoder.finish()) is not None:
                done = handle(event)
            result.latency = time.perf_counter() - start
            result.output_text = "".join(text_parts)
            if done:
                result.outcome, result.error = "ok", None
            else:
                result.outcome, result.error = "error", "stream ended without [DONE]"
    except _StreamError as e:
        result.outcome, result.error = "error", str(e)[:_MAX_ERROR_CHARS]
    except TimeoutError:
        result.outcome = "error"
        result.error = f"timeout: no complete response within {config.request_timeout:g} s"
    except Exception as e:  # a broken response must fail this request, not the whole run
        result.outcome, result.error = "error", f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]


class _StreamError(Exception):
    """The server reported an error inside a 200 stream."""


async def fetch_first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The id of the first model listed by ``GET /v1/models``."""
    response = await client.get(server_root(base_url) + "/v1/models", headers=auth_headers(api_key))
    if response.status_code != 200:
        raise RuntimeError(
            f"GET /v1/models failed: {error_text(response.status_code, response.content)}"
        )
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models returned no models; pass --model")
    return str(models[0]["id"])
