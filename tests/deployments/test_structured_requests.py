"""Request validation of structured-output and tool fields: each form becomes the engine's
constraint, and a bad one is a 400 naming its field before any engine sees it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deployments.config import AppArgs
from deployments.http_errors import HTTPError
from deployments.validation import RequestValidator
from engine.structured_output import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def validator(tiny_llama_with_tokenizer: Path) -> RequestValidator:
    return RequestValidator(
        AppArgs.model_validate({"model": str(tiny_llama_with_tokenizer), "served_model_name": "m"})
    )


def chat(validator: RequestValidator, **fields: Any):
    return validator.chat({"messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputs(json=SCHEMA),
        ),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
        ({"guided_regex": "[a-z]+"}, StructuredOutputs(regex="[a-z]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputs(choice=("a", "b"))),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputs(choice=("a",))),
        ({"tools": [TOOL], "tool_choice": "auto"}, None),
        (
            {
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            StructuredOutputs(json=TOOL["function"]["parameters"]),
        ),
    ],
)
def test_each_form_becomes_the_constraint(
    validator: RequestValidator, fields: dict, expected: StructuredOutputs | None
) -> None:
    assert chat(validator, **fields).params.structured_outputs == expected


def test_completions_take_the_guided_fields(validator: RequestValidator) -> None:
    job = validator.completion({"prompt": "x", "guided_choice": ["yes", "no"]})
    assert job.params.structured_outputs == StructuredOutputs(choice=("yes", "no"))


def test_tool_choice_required_asks_for_an_array_of_calls(validator: RequestValidator) -> None:
    spec = chat(validator, tools=[TOOL], tool_choice="required").params.structured_outputs
    assert spec is not None and spec.json["type"] == "array"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": 5}}}}, "guided_json"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    validator: RequestValidator, fields: dict, param: str
) -> None:
    with pytest.raises(HTTPError) as e:
        chat(validator, **fields)
    assert e.value.status == 400
    assert (e.value.param or "").split(".")[0] == param, e.value
