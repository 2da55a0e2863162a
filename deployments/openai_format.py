"""Building OpenAI-format response bodies and SSE chunks from engine stream items."""

from __future__ import annotations

import json
import time
from typing import Any


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def usage(lasts: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage from each choice's final item: the prompt counted once (as OpenAI does), the
    completions summed; cached tokens are the first choice's."""
    prompt = lasts[0]["prompt_tokens"]
    completion = sum(item["completion_tokens"] for item in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": lasts[0]["cached_tokens"]},
    }


class ResponseBuilder:
    """Shapes one request's items into OpenAI chat or completion objects, ``n`` choices each.

    Items carry their choice's ``index``; per choice the builder keeps the text offset of
    completion logprobs and the latest item (for usage)."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Any, n: int = 1) -> None:
        self.chat = kind == "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.n = n
        self.text_offsets = [0] * n
        self.lasts: list[dict[str, Any] | None] = [None] * n

    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])

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
                        "logprob": logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": self._token_str(t),
                                "logprob": lp,
                                "bytes": list(self._token_str(t).encode()),
                            }
                            for t, lp in top
                        ],
                    }
                )
            return {"content": content}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, logprob, top in raw:
            tok = self._token_str(token_id)
            tokens.append(tok)
            token_logprobs.append(logprob)
            tops.append({self._token_str(t): lp for t, lp in top} if top else None)
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(tok)
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

    def chunk(self, item: dict[str, Any]) -> dict[str, Any]:
        index = item.get("index", 0)
        self.lasts[index] = item
        body = self._head(True)
        finish = item["finish_reason"] if item["finished"] else None
        lp = self.logprobs(item.get("logprobs"), index)
        if self.chat:
            delta = {"content": item["text"]} if item["text"] or not item["finished"] else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": item["text"], "logprobs": lp, "finish_reason": finish}
        if item["finished"]:
            choice["stop_reason"] = item.get("stop_reason")
        body["choices"] = [choice]
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """After every choice's final chunk."""
        body = self._head(True)
        body["choices"] = []
        body["usage"] = usage([last for last in self.lasts if last is not None])
        return body

    # -- whole response --------------------------------------------------------------------------
    def full(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response from every item of every choice, in arrival order."""
        body = self._head(False)
        body["choices"] = [
            self._choice(index, [i for i in items if i.get("index", 0) == index])
            for index in range(self.n)
        ]
        body["usage"] = usage(
            [[i for i in items if i.get("index", 0) == k][-1] for k in range(self.n)]
        )
        return body

    def _choice(self, index: int, items: list[dict[str, Any]]) -> dict[str, Any]:
        last = items[-1]
        text = "".join(i["text"] for i in items)
        raw_lp = None
        if any(i.get("logprobs") for i in items):
            raw_lp = [x for i in items for x in (i.get("logprobs") or [])]
        lp = self.logprobs(raw_lp, index)
        if self.chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": last["finish_reason"],
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": last["finish_reason"],
            }
        choice["stop_reason"] = last.get("stop_reason")
        return choice
