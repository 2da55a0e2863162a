"""SSE decoding, request bodies and error texts of the streaming client."""

from __future__ import annotations

import math

import httpx
import pytest

from benchmarks.client import (
    ClientConfig,
    build_payload,
    error_text,
    synthetic_text,
    synthetic_word,
)
from benchmarks.serve import arrival_schedule
from benchmarks.sse import SSEDecoder, decode_sse_text
from benchmarks.workloads import WorkloadRequest


def test_sse_events_comments_multiline_and_missing_final_blank() -> None:
    text = (
        ": keep-alive\n\n"
        'data: {"a": 1}\n\n'
        "event: ping\ndata:x\ndata:  y\n\n"
        "id: 7\nretry: 10\n\n"  # no data: no event
        "data: [DONE]"  # stream cut before the blank line
    )
    events = decode_sse_text(text)
    assert [(e.event, e.data) for e in events] == [
        ("message", '{"a": 1}'),
        ("ping", "x\n y"),
        ("message", "[DONE]"),
    ]


def test_sse_event_time_is_its_first_line() -> None:
    d = SSEDecoder()
    assert d.feed_line("data: a", time=1.0) is None
    assert d.feed_line("data: b", time=2.0) is None
    event = d.feed_line("", time=3.0)
    assert event is not None and (event.data, event.time) == ("a\nb", 1.0)
    assert d.feed_line("", time=4.0) is None


def _cfg(**kw: object) -> ClientConfig:
    return ClientConfig(base_url="http://h:1/v1/", model="m", **kw)  # type: ignore[arg-type]


def test_completions_payload_sends_token_ids() -> None:
    req = WorkloadRequest(prompt_token_ids=[101, 102, 103], output_len=9)
    cfg = _cfg(ignore_eos=True, extra_body={"top_p": 0.5})
    assert cfg.url == "http://h:1/v1/completions"
    assert build_payload(req, cfg) == {
        "model": "m",
        "prompt": [101, 102, 103],
        "max_tokens": 9,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_p": 0.5,
    }
    text = build_payload(req, _cfg(prompt_format="text"))
    assert text["prompt"] == synthetic_text([101, 102, 103]) and "ignore_eos" not in text


def test_chat_payload_splits_system_prompt() -> None:
    req = WorkloadRequest(prompt_token_ids=[201, 202, 203, 204], output_len=3, shared_prefix_len=3)
    cfg = _cfg(endpoint="chat", temperature=0.7)
    body = build_payload(req, cfg, render=lambda ids: ",".join(map(str, ids)))
    assert cfg.url == "http://h:1/v1/chat/completions"
    assert body["messages"] == [
        {"role": "system", "content": "201,202,203"},
        {"role": "user", "content": "204"},
    ]
    assert body["temperature"] == 0.7 and "prompt" not in body
    plain = build_payload(WorkloadRequest([5, 6], 1), cfg, render=lambda ids: "q")
    assert plain["messages"] == [{"role": "user", "content": "q"}]


def test_synthetic_words_are_distinct_and_stable() -> None:
    words = [synthetic_word(i) for i in range(100, 5000)]
    assert len(set(words)) == len(words)
    assert synthetic_text([300, 301, 300]).split() == [words[200], words[201], words[200]]


def test_error_text() -> None:
    body = b'{"error": {"message": "too long", "type": "invalid_request_error", "param": null, "code": 400}}'
    assert error_text(400, body) == "HTTP 400: too long"
    headers = httpx.Headers({"Retry-After": "2"})
    assert error_text(429, b"slow down", headers) == "HTTP 429: slow down (Retry-After: 2)"
    assert error_text(422, b'{"detail": "bad"}') == "HTTP 422: bad"


def test_arrival_schedule() -> None:
    reqs = [WorkloadRequest([1], 1, arrival_time=t) for t in (0.0, 0.5, 0.25, 2.0)]
    assert arrival_schedule(reqs, None) == [0.0, 0.5, 0.5, 2.0]  # never goes back in time
    assert arrival_schedule(reqs, math.inf) == [0.0] * 4
    many = [WorkloadRequest([1], 1)] * 4000
    times = arrival_schedule(many, 20.0, seed=5)
    assert times == arrival_schedule(many, 20.0, seed=5)
    assert times[0] == 0.0 and all(a <= b for a, b in zip(times, times[1:], strict=False))
    assert len(many) / times[-1] == pytest.approx(20.0, rel=0.1)
    with pytest.raises(ValueError):
        arrival_schedule(many, 0.0)


@pytest.mark.slow
def test_tokenizer_renderer_resolves_model_names(smollm2_dir: object) -> None:
    from transformers import AutoTokenizer

    from benchmarks.client import tokenizer_renderer

    ids = AutoTokenizer.from_pretrained(str(smollm2_dir)).encode("The quick brown fox")
    render = tokenizer_renderer("smollm2-135m-instruct")
    assert render(ids) == "The quick brown fox"
