"""The request body must arrive within ``limits.body_read_timeout_s``: a client that trickles it
(or never finishes it) gets a 408 and holds nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from deployments.config import AppArgs
from deployments.frontend import OpenAIFrontend
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
