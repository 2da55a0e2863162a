"""Stream items built from the engine's per-step deltas (``engine.outputs.RequestDelta``) on an
engine replica: one item carries the new tokens of one choice, possibly several steps' worth
when the replica coalesces them."""

from __future__ import annotations

from deployments.engine_request import EngineRequest, StreamItem
from engine.outputs import RequestDelta


def delta_item(
    replica_id: str, batch: list[RequestDelta], index: int = 0, done: bool = True
) -> StreamItem:
    """One stream item: choice ``index``'s new tokens; ``finished`` ends the choice, ``done``
    the whole request (every choice finished)."""
    last = batch[-1]
    logprobs = None
    if any(d.logprobs for d in batch):
        logprobs = [(lp.token_id, lp.logprob, lp.top) for d in batch for lp in (d.logprobs or [])]
    scored = next((d.prompt_logprobs for d in batch if d.prompt_logprobs), None)
    prompt_logprobs = (
        None
        if scored is None
        else [None if e is None else (e.token_id, e.logprob, e.top) for e in scored]
    )
    return StreamItem(
        replica_id=replica_id,
        index=index,
        token_ids=[t for d in batch for t in d.new_token_ids],
        text="".join(d.new_text for d in batch),
        finished=last.finished,
        done=last.finished and done,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=last.num_output_tokens,
        cached_tokens=last.num_cached_tokens,
        remote_cached_tokens=last.num_remote_cached_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def timeout_item(
    replica_id: str,
    req: EngineRequest,
    last: RequestDelta | None,
    index: int = 0,
    done: bool = True,
) -> StreamItem:
    """The item that ends choice ``index`` of a request past its ``timeout_s``."""
    return StreamItem(
        replica_id=replica_id,
        index=index,
        token_ids=[],
        text="",
        finished=True,
        done=done,
        finish_reason="timeout",
        stop_reason=None,
        prompt_tokens=len(req.prompt_token_ids),
        completion_tokens=last.num_output_tokens if last else 0,
        cached_tokens=last.num_cached_tokens if last else 0,
        remote_cached_tokens=last.num_remote_cached_tokens if last else 0,
    )
