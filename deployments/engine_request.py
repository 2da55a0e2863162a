"""The contract between the HTTP side and the engine replicas: the request, and the stream's
items (``StreamItem``, ended by one with ``done`` or by an ``EngineError``).

``EngineRequest`` is a plain dataclass so that the request router (which Serve runs in the
ingress process and pickles by value) can read ``block_hashes`` by attribute without importing
this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams

# The code of the 429 that ends a request whose first token missed its deadline_ms.
DEADLINE_EXCEEDED = "deadline_exceeded"


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    # Validated by the HTTP side (deployments.validation).
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Chained hashes of the prompt's full blocks (engine.block_hash), for routing and KV import.
    block_hashes: list[int] = field(default_factory=list)
    priority: int = 0
    # Milliseconds from arrival at the engine replica by which the first token is due.
    deadline_ms: float | None = None
    timeout_s: float | None = None
    # False when the client waits for the whole answer: the replica then sends few, large items.
    stream: bool = True
    # Choices (OpenAI's n): engine requests sharing the prompt, streamed as one, items tagged
    # with their ``index``.
    n: int = 1
    # Folded into the block hashes (engine.block_hash.hash_root): ``block_hashes`` already are.
    cache_salt: str | None = None
    # The namespace ``block_hashes`` were computed under (engine.kv_fingerprint); a replica
    # whose own differs rehashes the prompt before it looks anything up.
    kv_namespace: str | None = None
    # The client's x-request-id header, for the replica's log lines (deployments.request_logging).
    x_request_id: str | None = None
    # W3C trace context (``traceparent``...) of the HTTP request's span, with tracing on
    # (deployments.tracing); the routing and engine replica spans are its children.
    trace_context: dict[str, str] | None = None
    # The conversation it belongs to (x-session-id header, else the OpenAI ``user`` field): the
    # request router sends a session's turns to its latest replica unless the cost says otherwise.
    session_id: str | None = None
    # The HTTP request this belongs to, the same for each of its prompts: the engine's fair
    # share (engine.fair_share) caps a group's sequences per step. None: this request's choices.
    group_id: str | None = None
    # The prompt as text (a chat's through its template), only under routing_policy
    # ray_prefix_affinity: Ray's PrefixCacheAffinityRouter matches the text of a request
    # argument's ``prompt`` (or ``messages``, which it looks for first, so this class has none).
    # Never empty when set: that router divides by its length. Our own policies read only
    # ``block_hashes``.
    prompt: str | None = None
    # Prefill/decode disaggregation (deployments.disaggregation): the replica publishes the
    # prompt's full blocks to the KV directory, and knows the directory holds them, before it
    # sends its last item, which reports them (``StreamItem.handoff_blocks``).
    handoff: bool = False
    # On the decode side's request of a handed-off prompt: the inter-token SLO its decode
    # replica is chosen by (router.slo); None: chosen as any request.
    tbt_slo_ms: float | None = None


@dataclass
class StreamItem:
    """New output of one choice. ``index`` is the choice (``prompt * n + k`` once the HTTP side
    has offset it); ``finished`` ends the choice, ``done`` the whole engine request (every
    choice finished). Counts are totals so far; logprobs are ``(token id, logprob, top)``."""

    replica_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    done: bool
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    remote_cached_tokens: int = 0
    logprobs: list[tuple[int, float, Any]] | None = None
    prompt_logprobs: list[tuple[int, float, Any] | None] | None = None
    # On the last item of a ``handoff`` request: the prompt's leading blocks the KV directory
    # holds for the decode side, their size, and the seconds the publish took.
    handoff_blocks: int = 0
    handoff_bytes: int = 0
    handoff_s: float = 0.0


@dataclass
class EngineError:
    """The last item of a stream that failed, as the HTTP answer it maps to. ``retryable``: the
    request never reached a working engine, so another replica may serve it."""

    status: int
    message: str
    type: str
    code: str | None = None
    retryable: bool = False


def error_item(
    status: int, message: str, type_: str, code: str | None = None, retryable: bool = False
) -> EngineError:
    return EngineError(status, message, type_, code, retryable)
