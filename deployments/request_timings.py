"""What one engine request records on the replica that runs it: when each of its choices got
its items, and once it ends, each finished choice's latency metrics, vLLM-compatible histograms,
trace span and (with ``enable_log_requests``) log line.

Invariants:

* ``arrival`` is taken when the replica starts the request (after admission); time to first
  token is the request's own (its first item over every choice), time per output token each
  choice's, over the time since that first item;
* a choice is recorded once, by ``record``, and only when its latest delta finished it and at
  least one item came: a choice cut short by a timeout, an error or a client that went away
  records nothing;
* the request counts as done only when every choice's latest delta finished it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from deployments.engine_request import EngineRequest
from deployments.vllm_metrics import ChoiceTimer
from engine.outputs import RequestDelta

if TYPE_CHECKING:
    from deployments.metrics import ReplicaMetrics
    from deployments.tracing import ReplicaTrace

logger = logging.getLogger("ray.serve")


class RequestTimings:
    """The timings of one engine request's ``req.n`` choices, fed every batch of deltas."""

    def __init__(self, req: EngineRequest, metrics: ReplicaMetrics, log_requests: bool) -> None:
        self.metrics = metrics
        self.log_requests = log_requests
        self.arrival = time.monotonic()
        if log_requests:
            logger.info(
                "engine request added: prompt_tokens=%d max_tokens=%s n=%d",
                len(req.prompt_token_ids),
                req.sampling.max_tokens,
                req.n,
            )
        self.first_at: float | None = None
        self.timers = [ChoiceTimer(self.arrival) for _ in range(req.n)]
        # Each choice's latest delta; a choice is finished when its latest delta is.
        self.last: list[RequestDelta | None] = [None] * req.n

    def on_batch(self, index: int, batch: list[RequestDelta]) -> bool:
        """Choice ``index`` got ``batch`` (one stream item's deltas); whether every choice has
        now finished."""
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.timers[index].on_item(sum(len(d.new_token_ids) for d in batch))
        self.last[index] = batch[-1]
        return all(d is not None and d.finished for d in self.last)

    def unfinished(self) -> list[int]:
        """The choices not finished yet, in order."""
        return [k for k, d in enumerate(self.last) if d is None or not d.finished]

    def record(self, trace: ReplicaTrace | None) -> None:
        """The request ended: record each finished choice (see the module's invariants)."""
        for k, (delta, timer) in enumerate(zip(self.last, self.timers, strict=True)):
            if delta is None or not delta.finished or self.first_at is None:
                continue
            if trace is not None:
                trace.choice(k, timer, delta)
            n = delta.num_output_tokens
            tpot = (time.monotonic() - self.first_at) / (n - 1) if n > 1 else None
            self.metrics.observe_request(self.first_at - self.arrival, tpot)
            self.metrics.vllm.observe_finished(timer, delta)
            if self.log_requests:
                logger.info(
                    "engine request finished: finish_reason=%s prompt_tokens=%d "
                    "output_tokens=%d cached_tokens=%d ttft_ms=%.1f e2e_ms=%.1f",
                    delta.finish_reason,
                    delta.num_prompt_tokens,
                    delta.num_output_tokens,
                    delta.num_cached_tokens,
                    1000 * ((delta.first_token_time or timer.last_at) - self.arrival),
                    1000 * (timer.last_at - self.arrival),
                )
