"""What the engine hands back: per-step deltas (serving) and whole outputs (offline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs


@dataclass
class RequestDelta:
    """What one request gained in one step. ``new_text`` never splits a character or shows part
    of a stop string; the final delta (``finished``) flushes whatever text was held back."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_remote_cached_tokens: int = 0
    # time.monotonic() of the request's first scheduling and first token, in the engine's
    # process (for queue / prefill / decode latencies).
    scheduled_time: float | None = None
    first_token_time: float | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Only on a request's first delta, and only when asked for (see Request.prompt_logprobs).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestOutput:
    """The whole result of one offline request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
