"""The step loop with planning overlapped: step N+1 is scheduled and its inputs built on a second
thread while step N's forward pass runs (``EngineConfig.async_scheduling``).

One ``step()``:

1. Take the plan made during the previous step (a ``SchedulerOutput`` and its prepared batch),
   or schedule and prepare now when there is none. Requests of the plan that finished since it
   was made (a stop, EOS or length at the previous step, an abort between steps) leave it and the
   rest is prepared again on this thread: they never run a step past their end, and their blocks
   were freed when they finished. A request the plan admitted to read blocks that one of them
   was to compute in the step (``engine.step_sharing``) goes back to waiting with it.
2. Fill in the input tokens that were still being sampled when the plan was made.
3. Count the step's progress before it runs (``Scheduler.update_from_output``), and mark every
   request that samples this step as having one token in flight (``Request.num_inflight_tokens``).
4. On the planning thread, schedule step N+1 as if each of those tokens were known, and prepare
   its batch; meanwhile run step N's forward and sampling on this thread.
5. Join the planner, clear the in-flight marks, then append the sampled tokens, detokenize, check
   stops and build deltas exactly as the serial step does.

Why it is safe: the planner and the forward share no state. The forward reads only its prepared
tensors and the KV cache tensors; the planner touches the scheduler, the block pool and request
bookkeeping, which the forward and sampler do not read (the sampler reads sampling parameters,
output tokens, generators and grammars, which only step 5 changes). Counting progress before the
forward (3.) registers the step's full blocks in the prefix cache while the forward is still
writing them; anyone who hits them runs in a later forward, after these writes. Blocks freed by a
preemption in the plan are likewise written by the running forward before any later one reuses
them. A request the plan preempts still receives the token step N sampled for it, as it would
have before being preempted in the serial loop.

What it changes: a request added between steps is admitted one step later (the next step was
planned before it arrived), and a step after one where a request finished re-prepares its batch
on this thread. Greedy outputs are those of the serial loop. Every feature overlaps: the grammar
mask, penalties and seeds are read at sampling time, after the previous step's tokens are
appended; prompt logprobs are placed by ``num_computed_tokens``, which the plan sees advanced.

Where it pays: bookkeeping is a small part of a CPU step whose forward keeps every core busy, so
there the planner mostly competes with the forward for the cores and the GIL; it pays where the
forward leaves the CPU idle (a device that computes while the engine thread waits for it).
Measured: docs/performance.md.

Threads: the planner's tensor ops (``ModelRunner.prepare``) are too small to enter an OpenMP
parallel region, so it starts no OpenMP team of its own (see ``engine.async_engine``).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.model_runner import BatchInputs, ModelRunner, ScheduledSeq, StepOutput
from engine.outputs import RequestDelta
from engine.scheduler import Scheduler, SchedulerOutput


class StepHost(Protocol):
    """The phases of a step the pipeline drives (``LLMEngine``'s)."""

    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner

    def scheduled_seqs(self, out: SchedulerOutput) -> list[ScheduledSeq]: ...

    def begin_step(self, out: SchedulerOutput) -> list[RequestDelta]: ...

    def observe_prefill(self, out: SchedulerOutput, started: float) -> None: ...

    def report_prefill_chunks(self, out: SchedulerOutput) -> None: ...

    def finish_step(self, step: StepOutput) -> list[RequestDelta]: ...


@dataclass
class StepPlan:
    """A scheduled step and its batch (None: to prepare when the step runs)."""

    out: SchedulerOutput
    batch: BatchInputs | None


class StepPipeline:
    """Drives ``LLMEngine`` steps with the next step planned during each forward. Used from the
    engine's one thread, as ``LLMEngine.step`` is; the planning thread runs only inside
    ``step()``."""

    def __init__(self, engine: StepHost) -> None:
        self.engine = engine
        self._planner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-plan")
        self._next: StepPlan | None = None

    def step(self) -> list[RequestDelta]:
        engine = self.engine
        scheduler = engine.scheduler
        plan = self._take_plan()
        if plan is None:
            plan = StepPlan(scheduler.schedule(), None)
        elif engine.config.reject_late_requests and scheduler.waiting:
            # Now, not when planned: a request is rejected in the step that reports it.
            scheduler.reject_late(plan.out)
        out = plan.out
        rejected = engine.begin_step(out)
        if out.is_empty:
            return rejected
        batch = plan.batch or engine.runner.prepare(engine.scheduled_seqs(out))
        batch.fill_pending()
        sampling = scheduler.update_from_output(out)
        for request in sampling:
            request.num_inflight_tokens = 1
        future = self._planner.submit(self._plan)
        try:
            started = time.perf_counter()
            result = engine.runner.run(batch)
            engine.observe_prefill(out, started)
        finally:
            # Whatever happened, the planner is done with the engine before this returns.
            self._next = future.result()
            for request in sampling:
                request.num_inflight_tokens = 0
        # Once the planner is done with the requests: their progress is settled.
        engine.report_prefill_chunks(out)
        return rejected + engine.finish_step(result)

    def _plan(self) -> StepPlan | None:
        """Planning thread: the next step, with the in-flight tokens counted as known."""
        engine = self.engine
        out = engine.scheduler.schedule(reject_late=False)
        if out.is_empty:
            return None
        return StepPlan(out, engine.runner.prepare(engine.scheduled_seqs(out)))

    def _take_plan(self) -> StepPlan | None:
        """The planned step without the requests that finished since it was planned (None: plan
        now)."""
        plan, self._next = self._next, None
        if plan is None:
            return None
        out = plan.out
        if self.engine.scheduler.drop_finished(out):
            plan.batch = None
        return None if out.is_empty else plan
