"""Reading and validating request bodies: the body must arrive within
``limits.body_read_timeout_s`` (a client that trickles it gets a 408), and a large body is parsed and
tokenized off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from starlette.requests import Request

from deployments.config import AppArgs
from deployments.frontend import OFFLOAD_BODY_BYTES, OpenAIFrontend
from deployments.http_errors import HTTPError


def _frontend(timeout_s: float) -> OpenAIFrontend:
    args = AppArgs.model_validate({"limits": {"body_read_timeout_s": timeout_s}})
    return OpenAIFrontend(args, backend=None, replica_id="r", reports=None)  # type: ignore[arg-type]


def _request(chunks: list[bytes], gap_s: float) -> Request:
    """A POST whose body arrives in ``chunks``, ``gap_s`` apart."""
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(gap_s)
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    return Request(scope, receive)


def test_a_body_in_time_is_read() -> None:
    body = json.dumps({"prompt": "hi"}).encode()
    request = _request([body[:5], body[5:]], gap_s=0.01)
    assert asyncio.run(_frontend(5.0).read_json(request)) == {"prompt": "hi"}


def test_a_trickled_body_gets_a_408() -> None:
    body = json.dumps({"prompt": "hi"}).encode()
    request = _request([body[i : i + 1] for i in range(len(body))], gap_s=0.05)
    with pytest.raises(HTTPError) as e:
        asyncio.run(_frontend(0.2).read_json(request))
    assert e.value.status == 408 and e.value.code == "body_timeout"
    assert "0.2 s" in str(e.value)


def test_limits_default_to_a_request_timeout_and_a_body_timeout() -> None:
    limits = AppArgs().limits
    assert limits.request_timeout_s == 900.0 and limits.body_read_timeout_s == 30.0
    assert (
        AppArgs.model_validate({"limits": {"request_timeout_s": None}}).limits.request_timeout_s
        is None
    )


def test_large_bodies_are_validated_in_the_worker_pool() -> None:
    frontend = _frontend(5.0)
    seen: list[str] = []

    def record(data: Any) -> int:
        seen.append(threading.current_thread().name)
        return len(data["prompt"])

    async def run(prompt: str) -> int:
        return await frontend.validate(record, json.dumps({"prompt": prompt}).encode())

    assert asyncio.run(run("small")) == 5
    assert asyncio.run(run("x" * OFFLOAD_BODY_BYTES)) == OFFLOAD_BODY_BYTES
    assert seen[0] == threading.main_thread().name
    assert seen[1].startswith("prefixserve-validate")


def test_a_validation_error_in_the_pool_is_the_request_s_answer() -> None:
    frontend = _frontend(5.0)
    body = json.dumps({"prompt": "x" * OFFLOAD_BODY_BYTES, "max_tokens": -1}).encode()
    with pytest.raises(HTTPError) as e:
        asyncio.run(frontend.validate(frontend.validator.completion, body))
    assert e.value.status == 400 and "max_tokens" in str(e.value)
