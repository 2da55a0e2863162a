"""Tool calls parsed from model output, whole and streamed token by token, for the Hermes/Qwen
and Llama 3 JSON formats; the streamed deltas, merged as OpenAI's client merges them, give the
same calls as the whole output. The chat template renders the tool definitions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deployments.chat_protocol import ChatCompletionRequest
from deployments.engine_request import StreamItem
from deployments.openai_format import ResponseBuilder, ToolParsing
from deployments.tool_calls import ToolCallStream, constraint, detect_format, parse
from engine.structured_output import StructuredOutputs

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2]}
TIME = {"tz": "Europe/Rome"}

OUTPUTS = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "get_time", "arguments": TIME})
        + "\n</tool_call>",
        "Let me check.",
    ),
    "llama3_json": (
        json.dumps({"name": "get_weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "get_time", "parameters": TIME}),
        None,
    ),
}


def merge_deltas(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """What a client accumulates from stream deltas: content, and calls by index (name and id
    from the first fragment, arguments concatenated)."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            call = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or c.get("id")
            fn = c.get("function") or {}
            call["name"] = call["name"] or fn.get("name")
            call["arguments"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def token_pieces(tokenizer: Any, text: str) -> list[str]:
    """``text`` as the detokenizer streams it: the decoded growth after each token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i])
        pieces.append(now[len(prev) :])
        prev = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("mode", ["hermes", "llama3_json"])
def test_whole_output_parses_into_tool_calls(mode: str) -> None:
    text, content = OUTPUTS[mode]
    parsed = parse(mode, text)
    assert parsed.content == content
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [WEATHER, TIME]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2


@pytest.mark.parametrize("mode", ["hermes", "llama3_json"])
def test_streamed_tokens_give_the_same_calls(mode: str, smollm2_tokenizer) -> None:
    text, content = OUTPUTS[mode]
    stream = ToolCallStream(mode)
    deltas = []
    for piece in token_pieces(smollm2_tokenizer, text):
        out, calls = stream.feed(piece)
        deltas.append({"content": out, "tool_calls": calls})
    out, calls = stream.finish()
    deltas.append({"content": out, "tool_calls": calls})
    got_content, got_calls = merge_deltas(deltas)
    assert got_content == (content or "")
    assert [c["name"] for c in got_calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in got_calls] == [WEATHER, TIME]
    # No marker text leaks into the streamed content.
    assert "<tool_call>" not in got_content and "{" not in got_content


@pytest.mark.parametrize("mode", ["hermes", "llama3_json"])
def test_plain_text_stays_content(mode: str, smollm2_tokenizer) -> None:
    for text in ("The weather is fine <tool", "Use {braces} freely.", "<tool_call>{not json"):
        assert parse(mode, text).content == text
        assert not parse(mode, text).tool_calls
        stream = ToolCallStream(mode)
        deltas = [
            dict(zip(("content", "tool_calls"), stream.feed(p), strict=True))
            for p in token_pieces(smollm2_tokenizer, text)
        ]
        deltas.append(dict(zip(("content", "tool_calls"), stream.finish(), strict=True)))
        assert merge_deltas(deltas) == (text, [])


def test_named_function_streams_its_arguments(smollm2_tokenizer) -> None:
    text = json.dumps(WEATHER)
    stream = ToolCallStream("named", "get_weather")
    deltas = [{"tool_calls": stream.feed(p)[1]} for p in token_pieces(smollm2_tokenizer, text)]
    deltas.append({"tool_calls": stream.finish()[1]})
    assert len([d for d in deltas if d["tool_calls"]]) > 2  # arguments arrive as they come
    content, calls = merge_deltas(deltas)
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == WEATHER


def test_required_output_becomes_calls() -> None:
    text = json.dumps([{"name": "get_time", "parameters": TIME}])
    parsed = parse("required", text)
    assert parsed.content is None
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == TIME


def test_constraints_of_tool_choice() -> None:
    tools = [
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "noop"}},
    ]
    assert constraint(tools, "auto") is None and constraint(tools, "none") is None
    assert constraint(tools, "get_time") == StructuredOutputs(json={"type": "object"})
    required = constraint(tools, "required")
    assert required is not None and required.json["minItems"] == 1
    required.check()


def final_item(text: str) -> StreamItem:
    return StreamItem("r", 0, [1], text, True, True, "stop", None, 3, 1, 0)


def test_response_builder_reports_calls_and_finish_reason(smollm2_tokenizer) -> None:
    text, _ = OUTPUTS["hermes"]
    item = final_item(text)
    builder = ResponseBuilder("chat", "id", "m", smollm2_tokenizer, tools=ToolParsing("hermes"))
    choice = builder.full([item])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert len(choice["message"]["tool_calls"]) == 2
    named = ResponseBuilder(
        "chat", "id", "m", smollm2_tokenizer, tools=ToolParsing("named", "get_time")
    )
    item = final_item(json.dumps(TIME))
    choice = named.full([item])["choices"][0]
    assert choice["finish_reason"] == "stop"  # as OpenAI ends a named tool_choice
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    '{% endfor %}\n</tools>\nReturn calls as <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_detection() -> None:
    assert detect_format(HERMES_TEMPLATE) == "hermes"
    assert detect_format("{{ '<|start_header_id|>' }}{{ '<|eot_id|>' }}") == "llama3_json"
    assert detect_format(None) == "hermes"


def test_tools_and_earlier_calls_go_through_the_chat_template(smollm2_tokenizer) -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather of a city",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                }
            ],
        }
    )
    text = smollm2_tokenizer.apply_chat_template(
        req.conversation(),
        tools=req.tool_definitions(),
        chat_template=HERMES_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '"name": "get_weather"' in text and "Weather of a city" in text
    # The earlier call's arguments reach the template as a mapping, rendered as JSON once.
    assert '"arguments": {"city": "Paris"' in text
