"""What the HTTP side runs engine requests on: a backend that opens streams (replicas chosen by
the request router through a handle, or the engine in this very process), the error that asks
for another attempt, and the prompt text a text-matching router reads."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from deployments.engine_request import EngineRequest, StreamItem
from deployments.http_errors import HTTPError


class EngineStream(Protocol):
    """One engine request's items: ``StreamItem``s, the last with ``done``, or an
    ``EngineError`` that ends it. ``cancel`` aborts the request."""

    def __anext__(self) -> Awaitable[StreamItem]: ...

    def cancel(self) -> None: ...


class EngineBackend(Protocol):
    """Where engine requests run. ``max_attempts``: tries per prompt (1 when a retry would
    land on the same engine, which also rules out resuming a stream). ``kv_namespace``: the
    engines' block-hash namespace, as they report it (None: not known yet). ``open``'s ``key``
    names a call made beside the request's others (a resumed choice), which must not share
    their routing identity."""

    max_attempts: int

    def open(
        self, req: EngineRequest, index: int, num_prompts: int, key: str | None = None
    ) -> EngineStream: ...

    async def kv_namespace(self) -> str | None: ...


class RetryableError(Exception):
    """An engine attempt failed, or was full, before the client saw anything: try again (after
    a pause when it failed). ``error`` is the answer if no attempt is left."""

    def __init__(self, error: HTTPError, backoff: bool = True) -> None:
        super().__init__(str(error))
        self.error = error
        self.backoff = backoff


def prompt_text(tokenizer: Any, token_ids: list[int]) -> str:
    """A prompt's tokens as text for a request router that matches text prefixes (Ray's
    ``PrefixCacheAffinityRouter``): decoded with special tokens kept, since the chat template's
    markers are cached like any other token. Never empty (that router divides by the length):
    without a tokenizer, or where the tokens decode to nothing, the ids written out."""
    text = "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=False)
    return text or " ".join(map(str, token_ids)) or " "
