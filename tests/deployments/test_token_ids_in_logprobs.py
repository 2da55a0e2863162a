"""vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``token_id:<id>`` (a token that
is not valid text on its own stays identifiable), while completions' text offsets still count
the text."""

from __future__ import annotations

from typing import Any

from deployments.validation import RequestValidator

# (token id, logprob, [(alternative id, logprob)])
RAW = [(6004, -0.5, [(6004, -0.5), (28, -1.5)]), (28, -0.25, [(28, -0.25)])]


def test_completion_logprobs_name_tokens_by_id(
    tiny_validator: RequestValidator, tiny_tokenizer: Any
) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": 2}
    named = tiny_validator.completion(
        {**body, "return_tokens_as_token_ids": True}
    ).builder.logprobs(RAW)
    plain = tiny_validator.completion(body).builder.logprobs(RAW)
    assert named["tokens"] == ["token_id:6004", "token_id:28"]
    assert named["top_logprobs"][0] == {"token_id:6004": -0.5, "token_id:28": -1.5}
    assert plain["tokens"] == [tiny_tokenizer.decode([6004]), tiny_tokenizer.decode([28])]
    assert named["text_offset"] == plain["text_offset"] == [0, len(tiny_tokenizer.decode([6004]))]


def test_chat_logprobs_name_tokens_by_id(tiny_validator: RequestValidator) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    job = tiny_validator.chat({**body, "return_tokens_as_token_ids": True})
    content = job.builder.logprobs(RAW)["content"]
    assert [c["token"] for c in content] == ["token_id:6004", "token_id:28"]
    assert content[0]["bytes"] == list(b"token_id:6004")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["token_id:6004", "token_id:28"]
