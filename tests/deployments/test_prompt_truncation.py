"""vLLM's ``truncate_prompt_tokens`` and ``truncation_side``: the prompt the engine gets keeps
that many tokens (the last ones by default), ``-1`` keeps what leaves room for ``max_tokens``,
and a size that cannot fit is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from deployments.validation import RequestValidator
from tests.deployments.support import refused_field

IDS = list(range(100, 160))
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


def completion(tiny_validator: RequestValidator, prompt: Any, **fields: Any) -> list[int]:
    return tiny_validator.completion({"prompt": prompt, "max_tokens": 4, **fields}).prompts[0]


def test_the_last_tokens_are_kept_unless_the_right_side_is_cut(
    tiny_validator: RequestValidator, tiny_tokenizer: Any
) -> None:
    assert completion(tiny_validator, IDS, truncate_prompt_tokens=10) == IDS[-10:]
    assert (
        completion(tiny_validator, IDS, truncate_prompt_tokens=10, truncation_side="right")
        == IDS[:10]
    )
    assert completion(tiny_validator, IDS, truncate_prompt_tokens=500) == IDS  # shorter already
    assert completion(tiny_validator, IDS) == IDS
    whole = tiny_tokenizer.encode(TEXT)
    assert completion(tiny_validator, TEXT, truncate_prompt_tokens=7) == whole[-7:]


def test_minus_one_leaves_room_for_max_tokens(tiny_validator: RequestValidator) -> None:
    room = tiny_validator.max_model_len - 4
    long = [100 + i % 1000 for i in range(tiny_validator.max_model_len + 50)]
    assert completion(tiny_validator, long, truncate_prompt_tokens=-1) == long[-(room - 1) :]


def test_chat_prompts_are_cut_after_the_template(
    tiny_validator: RequestValidator, tiny_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": TEXT}]
    whole = tiny_validator.chat({"messages": messages, "max_tokens": 4}).prompts[0]
    cut = tiny_validator.chat({"messages": messages, "max_tokens": 4, "truncate_prompt_tokens": 5})
    assert cut.prompts[0] == whole[-5:]


@pytest.mark.parametrize("size", [0, -2, 10**6])
def test_a_size_that_cannot_fit_names_the_field(
    tiny_validator: RequestValidator, size: int
) -> None:
    call = lambda: completion(tiny_validator, IDS, truncate_prompt_tokens=size)  # noqa: E731
    assert refused_field(call) == "truncate_prompt_tokens"


def test_an_echoed_prompt_is_the_truncated_one(
    tiny_validator: RequestValidator, tiny_tokenizer: Any
) -> None:
    job = tiny_validator.completion(
        {"prompt": TEXT, "max_tokens": 4, "echo": True, "truncate_prompt_tokens": 6}
    )
    kept = tiny_tokenizer.encode(TEXT)[-6:]
    assert job.prompts[0] == kept
    assert job.builder.echo[0].text == tiny_tokenizer.decode(kept)


def test_chat_keeps_room_for_max_completion_tokens(tiny_validator: RequestValidator) -> None:
    messages = [{"role": "user", "content": "word " * (tiny_validator.max_model_len + 100)}]
    whole = tiny_validator.chat(
        {"messages": messages, "max_tokens": 1, "truncate_prompt_tokens": 8}
    )
    assert len(whole.prompts[0]) == 8
    job = tiny_validator.chat(
        {"messages": messages, "max_completion_tokens": 20, "truncate_prompt_tokens": -1}
    )
    assert len(job.prompts[0]) == tiny_validator.max_model_len - 20 - 1
    assert job.params.max_tokens == 20
