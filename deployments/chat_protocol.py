"""The chat request schema (``/v1/chat/completions``): messages, tools and ``tool_choice``,
mapped onto SamplingParams through the fields every generation request shares
(``deployments.protocol``). Message bounds come from ``deployments.request_limits``."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from deployments import tool_calls
from deployments.output_fields import FunctionCall, NamedToolChoice, Tool, ToolCall
from deployments.protocol import Int64, ProtocolError, SamplingFields
from deployments.request_limits import MAX_CONTENT_PARTS, MAX_MESSAGE_CHARS, MAX_MESSAGES, MAX_TOOLS
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.structured_output import StructuredOutputs

# Arguments of transformers' apply_chat_template that the request's own fields (or the server)
# set: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


# Part types whose text a text-only model reads, and the key that holds it, as vLLM's chat parser
# takes them: OpenAI's text and refusal parts (a client replaying an assistant turn), and the
# Responses API's input and output text.
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class ChatMessage(BaseModel):
    """At most ``MAX_MESSAGE_CHARS`` characters of content, in at most ``MAX_CONTENT_PARTS``
    parts. The template reads the parts' texts joined by newlines, as vLLM's chat parser
    joins them for a text-only model."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Checked before the union: a part pydantic cannot take (an image, audio) would be
        # reported on the union's first branch ("content.str: Input should be a valid string"),
        # which names neither the part nor what is wrong with it.
        if not isinstance(value, list):
            return value
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
            if key is None:
                what = f"has type {kind!r}" if isinstance(kind, str) else "is not a text part"
                raise ValueError(
                    f"content part {i} {what}: this model takes text only, as a string or "
                    'parts of {"type": "text", "text": ...}'
                )
            if not isinstance(part.get(key), str):
                raise ValueError(f"content part {i}: {key} must be a string")
            parts.append({"type": "text", "text": part[key]})
        return parts

    @model_validator(mode="after")
    def _bounded(self) -> ChatMessage:
        # Checked after parsing: on a union, a field constraint's error would follow the other
        # branch's, and the first error is the one the client is shown.
        if isinstance(self.content, list) and len(self.content) > MAX_CONTENT_PARTS:
            raise ValueError(f"content: at most {MAX_CONTENT_PARTS} parts per message")
        if isinstance(self.content, str):
            size = len(self.content)
        else:  # the parts' characters; the newlines that join them are not the client's
            size = sum(len(part.text) for part in self.content or ())
        if size > MAX_MESSAGE_CHARS:
            raise ValueError(f"content: {size} characters; at most {MAX_MESSAGE_CHARS} per message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class Conversation(BaseModel):
    """Messages and tools, as the chat template receives them."""

    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    # None: the template opens an assistant turn unless the final message is continued.
    add_generation_prompt: StrictBool | None = None
    # vLLM's field: the output continues the final message (an assistant's answer begun by
    # the client) instead of starting a turn of its own.
    continue_final_message: StrictBool = False
    # vLLM's field: more variables for the chat template (Qwen3's enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's field: special tokens (a BOS) added on top of the template's own; off, as the
    # template writes them.
    add_special_tokens: StrictBool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must contain at least one message")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true together with add_generation_prompt")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or ()) & RESERVED_TEMPLATE_ARGS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the request's own fields, not here")
        return v

    @property
    def generation_prompt(self) -> bool:
        """Whether the chat template ends the prompt with the opening of an assistant turn."""
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return not self.continue_final_message

    def conversation(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.tool_calls:
                # Chat templates write arguments with tojson: they expect a mapping.
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _loads(c.function)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (transformers' ``tools=``)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class ChatCompletionRequest(Conversation, SamplingFields):
    max_completion_tokens: Int64 | None = None
    logprobs: StrictBool = False
    top_logprobs: Int64 | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @property
    def tool_choice_name(self) -> str | None:
        """``none``, ``auto``, ``required``, the named function, or None (no tools)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        if choice is None:
            return "auto" if self.tools else None
        return choice

    def _tool_constraint(self) -> tuple[str, StructuredOutputs] | None:
        choice = self.tool_choice_name
        if choice in (None, "none", "auto"):
            return None
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise ProtocolError(f"tool_choice: {choice!r} needs tools", "tool_choice")
        if choice != "required" and choice not in names:
            raise ProtocolError(f"tool_choice: no tool named {choice!r}", "tool_choice")
        spec = tool_calls.constraint(self.tool_definitions() or [], choice)
        return ("tool_choice", spec) if spec is not None else None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"top_logprobs: must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError("top_logprobs: requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        constraint = self.structured_output(self._tool_constraint())
        try:
            return self.sampling_params(max_tokens, logprobs, default_max_tokens, constraint)
        except ProtocolError as e:
            if e.param == "max_tokens":
                e.param = field
            raise


def _loads(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments
