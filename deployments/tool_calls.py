"""Tool calls: the constraint that ``tool_choice`` puts on the output, and parsing model output
into OpenAI's ``tool_calls``, whole or as streaming deltas.

Formats of free (``tool_choice: auto``) output, chosen from the model's chat template:

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, after optional text (the message's content);
- ``llama3_json`` (Llama 3.x): the whole output is one JSON object ``{"name": ...,
  "parameters": {...}}`` (or several separated by ``;``), optionally after ``<|python_tag|>``.

``tool_choice: required`` constrains the output to a JSON array of ``{"name", "parameters"}``
objects, one of the given functions each, and a named function to that function's parameters
object: both through structured outputs, so the arguments are always valid JSON whatever the
model's own format.

Invariant: a call's ``arguments`` is always a JSON text of an object; output that does not
parse as calls stays content, never a half-made call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output import StructuredOutputs

HERMES_START = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def detect_format(chat_template: str | None) -> str:
    """``hermes`` or ``llama3_json``, from the markers the chat template writes."""
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if PYTHON_TAG in template or "<|eot_id|>" in template:
        return "llama3_json"
    return "hermes"


def constraint(tools: list[dict[str, Any]], choice: str | None) -> StructuredOutputs | None:
    """The structured output that ``tool_choice`` demands: ``required`` an array of calls, a
    function name that function's parameters; ``auto``/``none``/None nothing."""
    if choice in (None, "auto", "none"):
        return None
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice != "required":
        return StructuredOutputs(json=_parameters(by_name[choice]))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": _parameters(fn)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, fn in by_name.items()
    ]
    return StructuredOutputs(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _as_call(obj: Any) -> dict[str, Any] | None:
    """``{"name": str, "arguments"|"parameters": object}`` as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], args)


def _json_objects(text: str) -> list[Any] | None:
    """The JSON values of ``text`` separated by ``;`` or whitespace, or None if any part is not
    JSON."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse(mode: str, text: str, function: str | None = None) -> ParsedOutput:
    """Split a whole output into content and calls. ``mode``: ``hermes``, ``llama3_json``,
    ``required`` or ``named`` (then ``function`` names the called function)."""
    if mode == "named":
        return ParsedOutput(None, [_call(function or "", text)])
    if mode == "required":
        values = _json_objects(text) or [[]]
        calls = [c for c in map(_as_call, values[0] if isinstance(values[0], list) else []) if c]
        return ParsedOutput(None, calls) if calls else ParsedOutput(text)
    if mode == "hermes":
        start = text.find(HERMES_START)
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for body in HERMES_CALL.findall(text, start):
            values = _json_objects(body)
            call = _as_call(values[0]) if values and len(values) == 1 else None
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].rstrip() or None, calls)
    body = text.strip().removeprefix(PYTHON_TAG)
    values = _json_objects(body) if body.startswith("{") else None
    calls = [_as_call(v) for v in values or []]
    if not calls or any(c is None for c in calls):
        return ParsedOutput(text)
    return ParsedOutput(None, calls)  # type: ignore[arg-type]


class ToolCallStream:
    """One choice's streamed output as content deltas and ``tool_calls`` deltas.

    Content streams as it comes until the output may be a call (``<tool_call>`` appears, or a
    llama3_json output starts with ``{``); from there text is held back and parsed when the
    choice finishes. A named function's arguments stream as they come."""

    def __init__(self, mode: str, function: str | None = None) -> None:
        self.mode = mode
        self.function = function
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content (or as arguments when named)
        self.held = mode == "required"
        self.called = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.mode == "named":
            calls = []
            if not self.called:
                self.called = True
                head = _call(self.function or "", "")
                calls.append({"index": 0, **head})
            if len(self.text) > self.sent:
                calls.append({"index": 0, "function": {"arguments": self.text[self.sent :]}})
                self.sent = len(self.text)
            return "", calls
        if not self.held:
            self.held = self._may_be_call()
        if self.held:
            return "", []
        # Hold back a tail that could be the start of a marker still arriving, and blanks that
        # may turn out to precede one (content ends before them).
        safe = len(self.text) - _partial_marker(self.text)
        safe = len(self.text[:safe].rstrip())
        out = self.text[self.sent : safe]
        self.sent = max(self.sent, safe)
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.mode == "named":
            return "", []
        if not self.held:
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return out, []
        parsed = parse(self.mode, self.text)
        self.called = bool(parsed.tool_calls)
        # Content is a prefix of the text (hermes: what comes before the first call).
        rest = (parsed.content or "") if self.called else self.text
        content = rest[self.sent :]
        calls = [{"index": i, **c} for i, c in enumerate(parsed.tool_calls)]
        return content, calls

    def _may_be_call(self) -> bool:
        if self.mode == "hermes":
            return HERMES_START in self.text
        head = self.text.lstrip()
        return bool(head) and (head.startswith("{") or head.startswith(PYTHON_TAG))


def _partial_marker(text: str) -> int:
    """Length of the longest tail of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-n:]):
            return n
    return 0
