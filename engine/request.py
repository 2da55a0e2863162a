"""A request and its state machine.

    WAITING ──schedule──> RUNNING ──stop/eos──> FINISHED_STOPPED
       ^                    │  │ ──max_tokens─> FINISHED_LENGTH
       │                    │  └──preempt───> PREEMPTED ──schedule──> RUNNING
       └────────────────────┴── abort (from any unfinished state) ──> FINISHED_ABORTED
    WAITING / PREEMPTED, before the first token, past the deadline ──> FINISHED_REJECTED
    RUNNING ──admission withdrawn before its step ran──> WAITING / PREEMPTED: a step planned
       ahead lost a request whose blocks this one was to read (Scheduler.drop_finished)
    PREEMPTED ──stop/eos/max_tokens──> FINISHED_STOPPED / FINISHED_LENGTH: a token sampled by a
       step that was running when the next step's plan preempted it (engine.step_pipeline)

``num_computed_tokens`` is the single source of truth for progress: the first
``num_computed_tokens`` of ``all_token_ids`` have their KV in the request's blocks. A preempted
request drops its blocks, so its ``num_computed_tokens`` returns to 0 and it recomputes (its prefix
may hit the cache again).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from engine.block_hash import BlockHash, extend_block_hashes
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.outputs import TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    # Could no longer meet its deadline (``EngineConfig.reject_late_requests``).
    FINISHED_REJECTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
}

_ALLOWED = {
    RequestStatus.WAITING: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_REJECTED,
    },
    RequestStatus.PREEMPTED: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_REJECTED,
    },
    RequestStatus.RUNNING: {
        RequestStatus.WAITING,
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    },
}


def prefill_tokens_left(num_tokens: int, num_computed_tokens: int, num_output_tokens: int) -> int:
    """Tokens still to compute before the decode phase: the rest of the prompt, or a preempted
    request's prompt and outputs (its newest token is the next decode's input, not prefill)."""
    return max(0, num_tokens - num_computed_tokens - (num_output_tokens > 0))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        arrival_time: float | None = None,
        deadline_ms: float | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
        block_size: int = 16,
        hash_root: bytes | None = None,
        group_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        # The client request this sequence belongs to (every prompt x n choice of one HTTP
        # request shares it; engine.fair_share); None: a group of its own.
        self.group_id: str = request_id if group_id is None else group_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # When the first token is due (``time.monotonic()`` seconds), or None: no deadline.
        self.deadline: float | None = (
            None if deadline_ms is None else self.arrival_time + deadline_ms / 1000.0
        )
        # Set once the request is known to have missed its deadline (counted once).
        self.missed_deadline = False
        self.detokenizer = detokenizer
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens a running step is sampling for this request, not yet in ``all_token_ids``: while
        # a forward runs, the next step is scheduled as if they were known (engine.step_pipeline).
        self.num_inflight_tokens = 0
        # Prompt tokens served from the prefix cache at first scheduling (-1: not yet scheduled).
        self.num_cached_tokens = -1
        self.num_remote_cached_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict] = []
        # With ``prompt_logprobs``: entry i belongs to prompt token i (entry 0 is None: nothing
        # predicts the first token). Filled as prefill chunks compute; a recompute after
        # preemption does not add entries twice. Empty when not asked for.
        self.prompt_logprobs: list[TokenLogprobs | None] = (
            [None] if sampling_params.prompt_logprobs is not None else []
        )
        self.block_size = block_size
        # The root of the block hash chain (engine.block_hash.hash_root; None: unnamespaced).
        self.hash_root = hash_root
        self.block_hashes: list[BlockHash] = []
        # time.monotonic() when first scheduled (the end of its queueing; not reset by preemption).
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # What a KV connector fetched for this request before it was added (engine.kv_connector);
        # the connector takes it when the request is added.
        self.kv_transfer: Any = None
        # torch.Generator of a seeded request, set by the engine.
        self.generator: Any = None
        # With structured_outputs: the grammar matcher (llguidance.LLMatcher), set by the engine;
        # it has consumed exactly the output tokens, so it survives preemption unchanged.
        self.grammar: Any = None
        # With bad_words: their token sequences (engine.bad_words), set by the engine.
        self.bad_word_tokens: tuple[tuple[int, ...], ...] = ()
        self.update_block_hashes()

    # -- derived ---------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prefill_tokens_left(self) -> int:
        return prefill_tokens_left(
            self.num_tokens, self.num_computed_tokens, self.num_output_tokens
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skips_prefix_cache(self) -> bool:
        """Cached KV has no logits: a request that wants every prompt position's must compute
        them all."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    # -- transitions -----------------------------------------------------------------------------
    def set_status(self, status: RequestStatus) -> None:
        if status not in _ALLOWED.get(self.status, set()):
            raise RuntimeError(f"request {self.request_id}: {self.status.name} -> {status.name}")
        self.status = status

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.hash_root)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
