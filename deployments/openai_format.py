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


def usage(item: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = item["prompt_tokens"], item["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": item["cached_tokens"]},
    }


class ResponseBuilder:
    """Shapes one request's items into OpenAI chat or completion objects."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Any) -> None:
        self.chat = kind == "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.text_offset = 0

    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])

    def logprobs(self, raw: list | None) -> dict[str, Any] | None:
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
            offsets.append(self.text_offset)
            self.text_offset += len(tok)
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
    def role_chunk(self) -> dict[str, Any]:
        body = self._head(True)
        body["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return body

    def chunk(self, item: dict[str, Any]) -> dict[str, Any]:
        body = self._head(True)
        finish = item["finish_reason"] if item["finished"] else None
        lp = self.logprobs(item.get("logprobs"))
        if self.chat:
            delta = {"content": item["text"]} if item["text"] or not item["finished"] else {}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": item["text"], "logprobs": lp, "finish_reason": finish}
        if item["finished"]:
            choice["stop_reason"] = item.get("stop_reason")
        body["choices"] = [choice]
        return body

    def usage_chunk(self, last: dict[str, Any]) -> dict[str, Any]:
        body = self._head(True)
        body["choices"] = []
        body["usage"] = usage(last)
        return body

    # -- whole response --------------------------------------------------------------------------
    def full(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        last = items[-1]
        text = "".join(i["text"] for i in items)
        raw_lp = None
        if any(i.get("logprobs") for i in items):
            raw_lp = [x for i in items for x in (i.get("logprobs") or [])]
        body = self._head(False)
        lp = self.logprobs(raw_lp)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": last["finish_reason"],
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": lp,
                "finish_reason": last["finish_reason"],
            }
        choice["stop_reason"] = last.get("stop_reason")
        body["choices"] = [choice]
        body["usage"] = usage(last)
        return body
