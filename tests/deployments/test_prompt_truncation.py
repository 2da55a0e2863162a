"""vLLM's ``truncate_prompt_tokens`` and ``truncation_side``: the prompt the engine gets keeps
that many tokens (the last ones by default), ``-1`` keeps what leaves room for ``max_tokens``,
and a size that cannot fit is a 400 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from deployments.config import AppArgs
from deployments.http_errors import HTTPError
from deployments.validation import RequestValidator

IDS = list(range(100, 160))
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def validator(tiny_llama_with_tokenizer: Path) -> RequestValidator:
    return RequestValidator(
        AppArgs.model_validate({"model": str(tiny_llama_with_tokenizer), "served_model_name": "m"})
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_with_tokenizer: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)


def completion(validator: RequestValidator, prompt: Any, **fields: Any) -> list[int]:
    return validator.completion({"prompt": prompt, "max_tokens": 4, **fields}).prompts[0]


def test_the_last_tokens_are_kept_unless_the_right_side_is_cut(
    validator: RequestValidator, tokenizer: Any
) -> None:
    assert completion(validator, IDS, truncate_prompt_tokens=10) == IDS[-10:]
    assert (
        completion(validator, IDS, truncate_prompt_tokens=10, truncation_side="right") == IDS[:10]
    )
    assert completion(validator, IDS, truncate_prompt_tokens=500) == IDS  # shorter already
    assert completion(validator, IDS) == IDS
    whole = tokenizer.encode(TEXT)
    assert completion(validator, TEXT, truncate_prompt_tokens=7) == whole[-7:]


def test_minus_one_leaves_room_for_max_tokens(validator: RequestValidator) -> None:
    room = validator.max_model_len - 4
    long = [100 + i % 1000 for i in range(validator.max_model_len + 50)]
    assert completion(validator, long, truncate_prompt_tokens=-1) == long[-(room - 1) :]


def test_chat_prompts_are_cut_after_the_template(
    validator: RequestValidator, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": TEXT}]
    whole = validator.chat({"messages": messages, "max_tokens": 4}).prompts[0]
    cut = validator.chat({"messages": messages, "max_tokens": 4, "truncate_prompt_tokens": 5})
    assert cut.prompts[0] == whole[-5:]


@pytest.mark.parametrize("size", [0, -2, 10**6])
def test_a_size_that_cannot_fit_names_the_field(validator: RequestValidator, size: int) -> None:
    with pytest.raises(HTTPError) as e:
        completion(validator, IDS, truncate_prompt_tokens=size)
    assert e.value.status == 400
    assert e.value.param == "truncate_prompt_tokens"


def test_an_echoed_prompt_is_the_truncated_one(validator: RequestValidator, tokenizer: Any) -> None:
    job = validator.completion(
        {"prompt": TEXT, "max_tokens": 4, "echo": True, "truncate_prompt_tokens": 6}
    )
    kept = tokenizer.encode(TEXT)[-6:]
    assert job.prompts[0] == kept
    assert job.builder.echo[0].text == tokenizer.decode(kept)


def test_chat_keeps_room_for_max_completion_tokens(validator: RequestValidator) -> None:
    messages = [{"role": "user", "content": "word " * (validator.max_model_len + 100)}]
    whole = validator.chat({"messages": messages, "max_tokens": 1, "truncate_prompt_tokens": 8})
    assert len(whole.prompts[0]) == 8
    job = validator.chat(
        {"messages": messages, "max_completion_tokens": 20, "truncate_prompt_tokens": -1}
    )
    assert len(job.prompts[0]) == validator.max_model_len - 20 - 1
    assert job.params.max_tokens == 20
