"""Building OpenAI-format response bodies and SSE chunks from engine stream items."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from deployments.engine_request import StreamItem
from deployments.tool_calls import ToolCallStream, parse


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# What a logprob of -inf (a token masked out: top-k, top-p, logit_bias -100) or NaN reads as in a
# response: JSON has no infinities, and clients parse this number (vLLM sends the same).
MIN_LOGPROB = -9999.0


def finite_logprob(lp: float | None) -> float | None:
    """``lp`` as a response carries it: None stays None (the first prompt token's), anything not
    a finite number at or above MIN_LOGPROB becomes MIN_LOGPROB."""
    if lp is None:
        return None
    return lp if math.isfinite(lp) and lp >= MIN_LOGPROB else MIN_LOGPROB


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def usage(
    lasts: list[StreamItem | None],
    n: int = 1,
    count_completion: bool = True,
    report_cached: bool = True,
) -> dict[str, Any]:
    """Usage from each choice's final item, in choice order (choice ``i * n + k`` is prompt
    ``i``'s choice ``k``): each prompt counted once (as OpenAI does), with its cached tokens
    unless ``report_cached`` is off; the completions summed. A choice with no item yet counts
    nothing."""
    prompt = cached = 0
    for start in range(0, len(lasts), n):
        head = next((x for x in lasts[start : start + n] if x is not None), None)
        if head is not None:
            prompt += head.prompt_tokens
            cached += head.cached_tokens
    completion = sum(x.completion_tokens for x in lasts if x is not None) if count_completion else 0
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if report_cached:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


@dataclass(frozen=True)
class ToolParsing:
    """How a chat request's output becomes ``tool_calls`` (``deployments.tool_calls.parse``'s
    ``mode``; ``function``: the one a named ``tool_choice`` calls)."""

    mode: str
    function: str | None = None


@dataclass(frozen=True)
class Echo:
    """A prompt as ``echo`` repeats it: its text and its token ids."""

    text: str
    token_ids: list[int]


class ResponseBuilder:
    """Shapes one request's items into OpenAI chat or completion objects.

    A request has ``num_prompts`` prompts of ``n`` choices each; items carry their choice's
    ``index`` (``prompt * n + choice``). Per choice the builder keeps the text offset of
    completion logprobs, the latest item (for usage) and whether its echo went out.
    With ``echo`` (completions) each choice starts with its prompt, and with
    ``echo_only`` the generated token is left out (``max_tokens: 0``)."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        tokenizer: Any,
        n: int = 1,
        *,
        num_prompts: int = 1,
        echo: list[Echo] | None = None,
        echo_only: bool = False,
        report_cached: bool = True,
        tools: ToolParsing | None = None,
        tokens_as_ids: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        self.chat = kind == "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.n = n
        self.echo = None if self.chat else echo
        self.echo_only = echo_only and self.echo is not None
        self.report_cached = report_cached
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>".
        self.tokens_as_ids = tokens_as_ids
        # vLLM's continuous_usage_stats: each content chunk carries the usage so far.
        self.continuous_usage = continuous_usage
        if echo is not None and len(echo) != num_prompts:
            raise ValueError("echo: one per prompt")
        self.num_choices = n * num_prompts
        self.text_offsets = [0] * self.num_choices
        self.lasts: list[StreamItem | None] = [None] * self.num_choices
        self.echoed = [False] * self.num_choices
        self.tools = tools if self.chat else None
        self.tool_streams = (
            [ToolCallStream(tools.mode, tools.function) for _ in range(self.num_choices)]
            if self.tools is not None
            else []
        )

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])

    def _token_str(self, token_id: int) -> str:
        """A token as logprobs name it."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self._text(token_id)

    def logprobs(self, raw: list | None, index: int = 0) -> dict[str, Any] | None:
        if raw is None:
            return None
        if self.chat:
            content = []
            for token_id, logprob, top in raw:
                tok = self._token_str(token_id)
                content.append(
                    {
                        "token": tok,
                        "logprob": finite_logprob(logprob),
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": self._token_str(t),
                                "logprob": finite_logprob(lp),
                                "bytes": list(self._token_str(t).encode()),
                            }
                            for t, lp in top
                        ],
                    }
                )
            return {"content": content}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, logprob, top in raw:
            text = self._text(token_id)
            tokens.append(f"token_id:{token_id}" if self.tokens_as_ids else text)
            token_logprobs.append(finite_logprob(logprob))
            tops.append({self._token_str(t): finite_logprob(lp) for t, lp in top} if top else None)
            offsets.append(self.text_offsets[index])
            # Offsets are into the text, whatever the tokens are named.
            self.text_offsets[index] += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- streaming -------------------------------------------------------------------------------
    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        body = self._head(True)
        body["choices"] = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return body

    def has_content(self, item: StreamItem) -> bool:
        """Whether the item makes a chunk: new tokens (even with no text yet: a special token, or
        bytes of a character still incomplete; as vLLM does, so a client times the first token
        when it is made), text or logprobs, a finish, or an echo due."""
        return bool(
            item.token_ids
            or item.text
            or item.finished
            or item.logprobs
            or (self.echo is not None and not self.echoed[item.index])
        )

    def _parts(self, index: int, items: list[StreamItem]) -> tuple[str, list | None]:
        """Text and raw logprob entries of a choice's items, after its echo if that is due."""
        text = "" if self.echo_only else "".join(i.text for i in items)
        raw = None
        if not self.echo_only and any(i.logprobs for i in items):
            raw = [x for i in items for x in (i.logprobs or [])]
        if self.echo is None or self.echoed[index]:
            return text, raw
        self.echoed[index] = True
        prompt = self.echo[index // self.n]
        scored = next((i.prompt_logprobs for i in items if i.prompt_logprobs), None)
        if scored is not None:
            # The first prompt token has nothing before it to be scored from.
            head = [(prompt.token_ids[0], None, None)]
            raw = head + [tuple(e) for e in scored[1:]] + (raw or [])
        return prompt.text + text, raw

    def _finish_reason(self, item: StreamItem) -> str | None:
        return "length" if self.echo_only else item.finish_reason

    def chunk(self, item: StreamItem) -> dict[str, Any]:
        index = item.index
        self.lasts[index] = item
        body = self._head(True)
        finish = self._finish_reason(item) if item.finished else None
        text, raw = self._parts(index, [item])
        lp = self.logprobs(raw, index)
        if self.chat and self.tools is not None:
            delta, finish = self._tool_delta(index, text, item.finished, finish)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        elif self.chat:
            delta = {"content": text} if text or not item.finished else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        if item.finished:
            choice["stop_reason"] = item.stop_reason
        body["choices"] = [choice]
        if self.continuous_usage:
            body["usage"] = usage(self.lasts, self.n, not self.echo_only, self.report_cached)
        return body

    def _tool_delta(
        self, index: int, text: str, finished: bool, finish: str | None
    ) -> tuple[dict[str, Any], str | None]:
        stream = self.tool_streams[index]
        content, calls = stream.feed(text)
        if finished:
            more, last_calls = stream.finish()
            content, calls = content + more, calls + last_calls
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, self._tool_finish(finish, stream.called)

    def _tool_finish(self, finish: str | None, called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a named tool_choice ends in "stop".
        assert self.tools is not None
        if finish == "stop" and called and self.tools.mode != "named":
            return "tool_calls"
        return finish

    def usage_chunk(self) -> dict[str, Any]:
        """After every choice's final chunk."""
        body = self._head(True)
        body["choices"] = []
        body["usage"] = usage(self.lasts, self.n, not self.echo_only, self.report_cached)
        return body

    # -- whole response --------------------------------------------------------------------------
    def full(self, items: list[StreamItem]) -> dict[str, Any]:
        """The whole response from every item of every choice, in arrival order."""
        by_choice: list[list[StreamItem]] = [[] for _ in range(self.num_choices)]
        for item in items:
            by_choice[item.index].append(item)
        body = self._head(False)
        body["choices"] = [self._choice(k, its) for k, its in enumerate(by_choice)]
        body["usage"] = usage(
            [its[-1] for its in by_choice], self.n, not self.echo_only, self.report_cached
        )
        return body

    def _choice(self, index: int, items: list[StreamItem]) -> dict[str, Any]:
        last = items[-1]
        text, raw = self._parts(index, items)
        lp = self.logprobs(raw, index)
        choice: dict[str, Any] = {"index": index}
        if self.chat and self.tools is not None:
            parsed = parse(self.tools.mode, text, self.tools.function)
            choice["message"] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                choice["message"]["tool_calls"] = parsed.tool_calls
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = lp
        choice["finish_reason"] = self._finish_reason(last)
        if self.chat and self.tools is not None:
            called = bool(choice["message"].get("tool_calls"))
            choice["finish_reason"] = self._tool_finish(choice["finish_reason"], called)
        choice["stop_reason"] = last.stop_reason
        return choice
