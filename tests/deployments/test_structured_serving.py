"""Structured output, tool calls and the tokenizer routes through the live server with the
official ``openai`` client: ``chat.completions.parse`` with a pydantic model, forced tool calls
streamed and not, /tokenize, /detokenize and /v1/models/{id}."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.deployments.conftest import deploy, undeploy

pytestmark = pytest.mark.ray

MESSAGES = [{"role": "user", "content": "Describe a city."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["utc_offset"],
            "additionalProperties": False,
        },
    },
}


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["FR", "IT", "JP"]
    population: int = Field(ge=0, le=10**8)
    capital: bool
    districts: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path) -> Iterator[str]:
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8},
            "stream_interval_ms": 5,
        },
        num_replicas=1,
    )
    yield serve_instance
    undeploy()


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    for seed in range(3):
        done = client.chat.completions.parse(
            model="tiny",
            messages=MESSAGES,
            response_format=City,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        city = done.choices[0].message.parsed
        assert isinstance(city, City), done.choices[0].message.content


def test_json_schema_streamed_validates(client: OpenAI) -> None:
    # Without additionalProperties false, any further keys would be valid (and unbounded).
    schema = {**City.model_json_schema(), "additionalProperties": False}
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        max_tokens=300,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_have_valid_json_arguments(
    client: OpenAI, stream: bool, tool_choice: str
) -> None:
    choice = (
        {"type": "function", "function": {"name": "get_time"}}
        if tool_choice == "named"
        else "required"
    )
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=choice,
        max_tokens=200,
        temperature=1.0,
        seed=5,
    )
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            assert not delta.content
            for c in delta.tool_calls or []:
                call = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or c.id
                if c.function and c.function.name:
                    call["name"] = c.function.name
                call["arguments"] += (c.function and c.function.arguments) or ""
            finish = chunk.choices[0].finish_reason or finish
        got = [calls[i] for i in sorted(calls)]
    else:
        done = client.chat.completions.create(**kwargs)
        finish = done.choices[0].finish_reason
        got = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in done.choices[0].message.tool_calls
        ]
    assert got and all(c["id"] for c in got)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for call in got:
        jsonschema.validate(json.loads(call["arguments"]), tools[call["name"]])
    if tool_choice == "named":
        assert [c["name"] for c in got] == ["get_time"] and finish == "stop"
    else:
        assert finish == "tool_calls"


def test_bad_schema_is_a_400_naming_the_field(base_url: str) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "guided_regex": "(("},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def test_guided_choice_on_completions(client: OpenAI) -> None:
    done = client.completions.create(
        model="tiny",
        prompt="Pick one:",
        max_tokens=20,
        n=3,
        extra_body={"guided_choice": ["ab", "cd"]},
    )
    # Each choice has a grammar of its own.
    assert len(done.choices) == 3 and all(c.text in ("ab", "cd") for c in done.choices)


def test_tokenize_detokenize_and_model_card(base_url: str, smollm2_tokenizer) -> None:
    text = "Hello, caches!"
    r = httpx.post(f"{base_url}/tokenize", json={"model": "tiny", "prompt": text}, timeout=30)
    body = r.json()
    assert body["tokens"] == smollm2_tokenizer.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    r = httpx.post(
        f"{base_url}/tokenize",
        json={"messages": MESSAGES, "return_token_strs": True, "tools": [TIME_TOOL]},
        timeout=30,
    )
    chat = r.json()
    expected = smollm2_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat["tokens"] == list(expected)
    assert chat["token_strs"] == smollm2_tokenizer.convert_ids_to_tokens(chat["tokens"])
    r = httpx.post(f"{base_url}/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert r.json() == {"prompt": smollm2_tokenizer.decode(body["tokens"])}
    r = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"

    card = httpx.get(f"{base_url}/v1/models/tiny", timeout=30).json()
    assert card["id"] == "tiny" and card["object"] == "model"
    r = httpx.get(f"{base_url}/v1/models/other", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
