"""Iteration-level scheduling under a token budget.

Each ``schedule()`` builds one step:

1. Running requests first, in policy order: a decode costs 1 token, an unfinished prefill a
   chunk of at most the remaining budget. When the pool cannot hold a running request's next
   tokens, the running request last in policy order that is not yet scheduled this step is
   preempted (under ``deadline``: the lowest priority, then the latest deadline); its blocks are
   freed, its progress reset, and it goes back to the waiting queue and recomputes later.
2. Then waiting requests, in policy order, while the budget, ``max_num_seqs`` and the blocks allow,
   each admitted with its prefix-cache hit and leaving the adaptive watermark's reserve of free
   blocks while others run. Admission stops at the first request that does not fit (no overtaking, so no
   starvation), and is skipped entirely in a step that had to preempt.
3. A waiting request reads, after its prefix-cache hit, the consecutive full blocks that a
   request already scheduled in this step completes in it (same hash: the same tokens behind the
   same prefix; ``engine.step_sharing``): a burst behind one new system prompt computes the
   prompt once, in the step that admits the whole burst, and the followers count it as cached.
   A request whose next block after those is one that a running request is still computing
   and will not complete in this step (its chunk stops short of it, or it sits the step out)
   waits, and the requests behind it may go first, rather than compute that block a second time. The wait ends
   when those blocks are computed (or their owner leaves), so it is bounded by one prefill. A
   block past the last one a hit could serve (the request must compute its last token) never
   makes it wait.

Prefill chunks and decodes share a step, so a long prompt never stalls running streams.

With ``max_seqs_per_group``, the running pass (1.) and admission (2.) give each client request's
group of sequences at most that many places in a step while other groups have work
(``engine.fair_share``): the running sequences it leaves out sit the step out with their blocks,
and its waiting sequences are passed over like those behind an in-flight prefix (3.).

Order: ``EngineConfig.scheduling_policy`` names a tuple of scorers (``engine.scheduling_policy``)
that orders both queues and picks preemption victims (the largest key). Admission leaves the
adaptive watermark's reserve free (``engine.admission_watermark``). With
``reject_late_requests``, a request still waiting for its first token once its deadline has
passed is finished as rejected at the start of the step, before it takes any block.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.admission_watermark import AdmissionWatermark
from engine.config import EngineConfig
from engine.fair_share import FairShare
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduling_policy import policy_scorers
from engine.step_sharing import SharedRun, StepBlocks


@dataclass
class SchedulerOutput:
    """One step's work: ``scheduled[i] = (request, num_new_tokens)``."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests admitted for the first time this step (their prefix-cache hit is now known).
    first_scheduled: list[Request] = field(default_factory=list)
    # Requests finished as rejected this step (deadline passed before their first token).
    rejected: list[Request] = field(default_factory=list)
    # request_id -> the requests of this step that compute blocks it reads (engine.step_sharing):
    # they must run in the same step.
    shared_from: dict[str, list[Request]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Requests ordered by the policy's key; preempted requests keep their original key, so under
    FCFS they come back ahead of everything that arrived after them."""

    def __init__(self, policy: str | tuple[str, ...]) -> None:
        self.policy = policy
        self._scorers = policy_scorers(policy)  # type: ignore[arg-type]
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []
        self._seq = itertools.count()

    def key(self, request: Request) -> tuple:
        """Computed once per request: every scorer reads a value fixed for its lifetime."""
        key = getattr(request, "_queue_key", None)
        if key is None:
            key = (*(score(request) for score in self._scorers), next(self._seq))
            request._queue_key = key  # type: ignore[attr-defined]
        return key

    def push(self, request: Request) -> None:
        key = self.key(request)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, request)

    def peek(self) -> Request:
        return self._reqs[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, request: Request) -> bool:
        for i, r in enumerate(self._reqs):
            if r is request:
                del self._keys[i]
                del self._reqs[i]
                return True
        return False

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self):
        return iter(self._reqs)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.watermark = AdmissionWatermark.for_pool(
            kv.num_blocks, config.watermark, config.adaptive_watermark
        )
        self.waiting = WaitingQueue(config.scheduling_policy)
        # Kept in policy order (the waiting queue's key), so that the running loop serves the
        # most important requests first and preemption victims come from the tail.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.fair_share = FairShare(config.max_seqs_per_group)

    # -- queue management ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.fair_share.on_add(request)
        self.waiting.push(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Move a request to a finished state and release everything it holds."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.set_status(status)
        free_before = self.kv.pool.num_free_blocks
        self.kv.free(request)
        self.watermark.on_release(self.kv.pool.num_free_blocks - free_before)
        self.requests.pop(request.request_id, None)
        self.fair_share.on_finish(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Tokens still to be computed before every running or waiting request reaches its decode
        phase: the rest of a prompt, or a preempted request's prompt and outputs (its newest
        token is the next decode's input, not prefill). Waiting requests count in full, although
        part of a prompt may hit the prefix cache when they are admitted."""
        return sum(r.num_prefill_tokens_left for r in self.requests.values())

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------------------------
    def _victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=self.waiting.key)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.set_status(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push(request)

    def reject_late(self, out: SchedulerOutput) -> None:
        """Finish as rejected the waiting requests whose deadline passed before a first token
        (``reject_late_requests``), into ``out.rejected``."""
        now = self.clock()
        late = [
            r
            for r in self.waiting
            if r.deadline is not None and r.first_token_time is None and r.deadline <= now
        ]
        for request in late:
            request.missed_deadline = True
            self.finish_request(request, RequestStatus.FINISHED_REJECTED)
            out.rejected.append(request)

    def schedule(self, reject_late: bool = True) -> SchedulerOutput:
        """The next step. ``reject_late=False`` leaves late requests waiting: a step planned
        ahead rejects when it runs (``engine.step_pipeline``)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if reject_late and self.config.reject_late_requests and self.waiting:
            self.reject_late(out)
        share = self.fair_share
        share.begin_step(self.running, self.waiting)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            known = request.num_tokens + request.num_inflight_tokens
            num_new = min(known - request.num_computed_tokens, budget)
            if num_new <= 0 or not share.runs(request):
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._victim(self.running[i:])
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                share.scheduled(request)
                budget -= num_new
                i += 1
                continue
            # The request preempted itself: nothing after it can fit either.
            break

        if out.preempted:
            self.watermark.on_preemption(self.kv.num_blocks - self.kv.pool.num_free_blocks)
            return out
        self.kv.watermark_blocks = self.watermark.reserve

        # Only needed to admit someone; a steady decode step has nobody waiting.
        inflight = self._inflight_block_hashes() if self.waiting else None
        step_blocks = self._step_blocks(out) if inflight is not None else None
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not share.admits(request):
                deferred.append(self.waiting.pop())
                continue
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            shared = SharedRun()
            if step_blocks is not None and not request.skips_prefix_cache:
                shared = step_blocks.extend(request, len(computed_blocks))
                num_cached += len(shared.blocks) * self.kv.block_size
            next_block = num_cached // self.kv.block_size
            if (
                inflight is not None
                and not request.skips_prefix_cache
                and next_block < (request.num_tokens - 1) // self.kv.block_size
                and request.block_hashes[next_block] in inflight
            ):
                deferred.append(self.waiting.pop())
                continue
            num_new = min(request.num_tokens - num_cached, budget)
            # The watermark protects running requests; with none, a request that needs nearly
            # the whole pool must still be admitted or it would wait forever.
            use_watermark = bool(self.running)
            if not self.kv.allocate_slots(
                request, num_new, computed_blocks, use_watermark, shared.blocks
            ):
                break
            self.waiting.pop()
            request.set_status(RequestStatus.RUNNING)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                out.first_scheduled.append(request)
            bisect.insort(self.running, request, key=self.waiting.key)
            out.scheduled.append((request, num_new))
            if shared.leaders:
                out.shared_from[request.request_id] = shared.leaders
            share.scheduled(request)
            budget -= num_new
            if inflight is not None:
                inflight.update(request.block_hashes[next_block:])
            if step_blocks is not None:
                step_blocks.add(request, num_new)
        for request in deferred:
            self.waiting.push(request)  # same key: back in its place
        return out

    def _step_blocks(self, out: SchedulerOutput) -> StepBlocks:
        """The blocks the running requests scheduled so far complete in this step."""
        step_blocks = StepBlocks(self.kv)
        for request, num_new in out.scheduled:
            step_blocks.add(request, num_new)
        return step_blocks

    def _inflight_block_hashes(self) -> set | None:
        """Hashes of the full blocks that running requests have yet to compute (None without
        prefix caching, where nothing could be shared anyway)."""
        if not self.config.enable_prefix_caching:
            return None
        bs = self.kv.block_size
        return {h for r in self.running for h in r.block_hashes[r.num_computed_tokens // bs :]}

    def drop_finished(self, out: SchedulerOutput) -> bool:
        """Take out of ``out``, a step planned ahead and not yet run (``engine.step_pipeline``),
        the requests that finished since it was planned (their blocks are already freed), and
        withdraw the admission of every request that was to read blocks one of those would have
        computed in it (``out.shared_from``; and so on down the chain): it goes back to the
        waiting queue as if never admitted. Returns whether ``out`` changed."""
        gone = {r.request_id for r, _ in out.scheduled if r.is_finished}
        if not gone:
            return False
        kept: list[tuple[Request, int]] = []
        # Leaders come before their followers in a step's order.
        for request, num_new in out.scheduled:
            if request.request_id in gone:
                continue
            leaders = out.shared_from.get(request.request_id, ())
            if any(leader.request_id in gone for leader in leaders):
                self._withdraw(request, out)
                gone.add(request.request_id)
                continue
            kept.append((request, num_new))
        out.scheduled = kept
        out.first_scheduled = [r for r in out.first_scheduled if r.request_id not in gone]
        out.shared_from = {f: ls for f, ls in out.shared_from.items() if f not in gone}
        return True

    def _withdraw(self, request: Request, out: SchedulerOutput) -> None:
        """Undo ``request``'s admission in ``out``, which has not run: a request admitted for
        the first time waits again as new, a readmitted preempted one as preempted. No
        preemption is counted; nothing it holds was written."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        if request in out.first_scheduled:
            request.num_cached_tokens = -1
            request.set_status(RequestStatus.WAITING)
        else:
            request.set_status(RequestStatus.PREEMPTED)
        self.waiting.push(request)

    def update_from_output(self, out: SchedulerOutput) -> list[Request]:
        """Advance progress after the model ran ``out``. Returns the requests that reached the end
        of their known tokens this step, i.e. that sampled a token."""
        sampled = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            self.kv.cache_computed_blocks(request)
            if request.num_computed_tokens >= request.num_tokens:
                sampled.append(request)
        return sampled
