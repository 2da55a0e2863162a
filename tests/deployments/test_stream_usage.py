"""Usage in a stream: with ``stream_options.include_usage`` one chunk after the choices, and with
vLLM's ``continuous_usage_stats`` too every content chunk with the counts so far."""

from __future__ import annotations

from typing import Any

import pytest

from deployments.engine_request import StreamItem
from deployments.validation import RequestValidator
from tests.deployments.support import refused_field


def item(completion_tokens: int, finished: bool) -> StreamItem:
    return StreamItem(
        "r", 0, [28], "x", finished, finished, "length" if finished else None, None, 5,
        completion_tokens, 2,
    )  # fmt: skip


def chunks(tiny_validator: RequestValidator, **options: Any) -> list[dict[str, Any]]:
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": options}
    builder = tiny_validator.completion(body).builder
    return [builder.chunk(item(1, False)), builder.chunk(item(2, True)), builder.usage_chunk()]


def test_continuous_usage_counts_each_chunk(tiny_validator: RequestValidator) -> None:
    first, second, last = chunks(tiny_validator, include_usage=True, continuous_usage_stats=True)
    assert first["usage"]["completion_tokens"] == 1
    assert second["usage"] == last["usage"]
    assert last["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


@pytest.mark.parametrize("options", [{"include_usage": True}, {"continuous_usage_stats": True}, {}])
def test_otherwise_only_the_final_chunk_has_usage(
    tiny_validator: RequestValidator, options: dict[str, bool]
) -> None:
    first, second, _ = chunks(tiny_validator, **options)
    assert "usage" not in first and "usage" not in second


def test_stream_options_need_a_stream(tiny_validator: RequestValidator) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hi", "stream_options": options}
    assert refused_field(lambda: tiny_validator.completion(body)) == "stream_options"
