"""What the ingress sends an engine replica, and what comes back on the stream.

``EngineRequest`` is a plain dataclass so that the request router (which Serve runs in the
ingress process and pickles by value) can read ``block_hashes`` by attribute without importing
this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    # SamplingParams keyword arguments (validated by the ingress).
    sampling: dict[str, Any]
    # Chained hashes of the prompt's full blocks (engine.block_hash), for routing and KV import.
    block_hashes: list[int] = field(default_factory=list)
    priority: int = 0
    timeout_s: float | None = None
    # False when the client waits for the whole answer: the replica then sends few, large items.
    stream: bool = True
    # Choices (OpenAI's n): engine requests sharing the prompt, streamed as one, items tagged
    # with their ``index``.
    n: int = 1


def error_item(status: int, message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    """A stream item that ends the stream with an HTTP-mappable error."""
    return {"error": {"status": status, "message": message, "type": type_, "code": code}}
