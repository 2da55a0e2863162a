"""What a chat request passes its template besides the messages: ``add_generation_prompt`` and
vLLM's ``continue_final_message`` reach it as transformers takes them (the two together are a
400 naming the field, as vLLM refuses them), and vLLM's ``chat_template_kwargs`` become template
variables, but never the arguments the request's own fields set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from deployments.config import AppArgs
from deployments.validation import RequestValidator
from tests.deployments.support import refused_field

BEGUN = [
    {"role": "user", "content": "Name the capital of France."},
    {"role": "assistant", "content": "The capital of France is"},
]


def reference(tiny_tokenizer: Any, messages: list[dict], **flags: bool) -> list[int]:
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, **flags)
    return tiny_tokenizer.encode(text, add_special_tokens=False)


def prompt(tiny_validator: RequestValidator, messages: list[dict], **fields: Any) -> list[int]:
    return tiny_validator.chat({"messages": messages, "max_tokens": 4, **fields}).prompts[0]


def test_a_continued_final_message_ends_the_prompt(
    tiny_validator: RequestValidator, tiny_tokenizer: Any
) -> None:
    ids = prompt(tiny_validator, BEGUN, continue_final_message=True)
    assert ids == reference(tiny_tokenizer, BEGUN, continue_final_message=True)
    assert tiny_tokenizer.decode(ids).endswith("The capital of France is")
    # Also with the generation prompt turned off explicitly, as vLLM's clients send it.
    assert ids == prompt(
        tiny_validator, BEGUN, continue_final_message=True, add_generation_prompt=False
    )


def test_by_default_the_prompt_opens_an_assistant_turn(
    tiny_validator: RequestValidator, tiny_tokenizer: Any
) -> None:
    ids = prompt(tiny_validator, BEGUN)
    assert ids == reference(tiny_tokenizer, BEGUN, add_generation_prompt=True)
    assert ids != prompt(tiny_validator, BEGUN, continue_final_message=True)
    assert prompt(tiny_validator, BEGUN, add_generation_prompt=False) == reference(
        tiny_tokenizer, BEGUN, add_generation_prompt=False
    )


def test_continuing_and_opening_a_turn_at_once_is_refused(tiny_validator: RequestValidator) -> None:
    both = {"continue_final_message": True, "add_generation_prompt": True}
    assert refused_field(lambda: prompt(tiny_validator, BEGUN, **both)) == "continue_final_message"


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    "{% endif %}"
)


def test_template_kwargs_become_template_variables(tiny_llama_with_tokenizer: Path) -> None:
    # A validator and a reference tokenizer of their own: the template is swapped in both.
    validator = RequestValidator(
        AppArgs.model_validate({"model": str(tiny_llama_with_tokenizer), "served_model_name": "m"})
    )
    validator.tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    question = BEGUN[:1]
    off = prompt(validator, question, chat_template_kwargs={"enable_thinking": False})
    assert off == reference(tokenizer, question, add_generation_prompt=True, enable_thinking=False)
    assert tokenizer.decode(off).endswith("<think>\n\n</think>\n")
    assert prompt(validator, question) == reference(tokenizer, question, add_generation_prompt=True)
    assert prompt(validator, question) != off


@pytest.mark.parametrize(
    "kwargs", [{"tokenize": True}, {"add_generation_prompt": False, "x": 1}, [1, 2], "on"]
)
def test_template_kwargs_may_not_set_the_request_s_own_arguments(
    tiny_validator: RequestValidator, kwargs: Any
) -> None:
    call = lambda: prompt(tiny_validator, BEGUN, chat_template_kwargs=kwargs)  # noqa: E731
    assert refused_field(call) == "chat_template_kwargs"
