"""One simulated engine replica: the engine's own scheduler and KV cache manager, a timed step.

The replica runs ``engine.scheduler.Scheduler`` over ``engine.kv_cache_manager.KVCacheManager``
(and so ``engine.block_pool.BlockPool``) unchanged: admission under the token budget and
``max_num_seqs``, chunked prefill, the watermark, preemption, prefix hits capped at
``prompt_len - 1`` tokens and the eviction order (an LRU free queue; a finished request's tail
blocks are evicted first) are the engine's by construction. Only the model is replaced: a step
takes the time the profile's cost model gives for its batch, and "sampling" appends a token.

:class:`SimRequest` provides exactly the attributes of ``engine.request.Request`` that the
scheduler and KV cache manager read, without token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.sim.profile import StepCost
from benchmarks.sim.ray_policies import KVSignals
from benchmarks.sim.trace import SimRequestSpec
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import RequestStatus, prefill_tokens_left
from engine.scheduler import Scheduler, SchedulerOutput

_MAX_MODEL_LEN = 1 << 40  # the simulator does not limit sequence length


class SimRequest:
    """A request as the engine's scheduler sees it, plus the times the simulator records.

    Invariants: ``block_hashes`` covers every block the request can ever fill (prompt blocks from
    the trace, then per-request unique negative ids for blocks holding generated tokens, which
    nothing else can hit, as in the live replay where outputs are the model's own tokens);
    ``num_cached_tokens`` is -1 until first admission, then the prefix hit at that admission;
    ``token_times`` holds the time of every output token so far, in order (its first entry is
    ``first_token_time``); the request finishes on its replica after ``stop_after`` tokens
    (``output_len`` unless it continues elsewhere, see ``benchmarks/sim/disagg.py``).
    """

    __slots__ = (
        "spec",
        "request_id",
        "group_id",
        "num_prompt_tokens",
        "output_len",
        "num_output_tokens",
        "num_computed_tokens",
        "num_inflight_tokens",
        "status",
        "arrival_time",
        "priority",
        "deadline",
        "num_cached_tokens",
        "num_remote_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "_queue_key",
        "replica",
        "first_token_time",
        "finish_time",
        "token_times",
        "stop_after",
    )

    def __init__(self, spec: SimRequestSpec, block_tokens: int) -> None:
        self.spec = spec
        self.request_id = f"r{spec.index}"
        # Its own fair-share group (engine.fair_share): a trace request is one client request.
        self.group_id = self.request_id
        self.num_prompt_tokens = spec.prompt_len
        self.output_len = spec.output_len
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        # The simulator steps serially: no token is ever in flight (engine.step_pipeline).
        self.num_inflight_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = spec.arrival
        self.priority = 0
        self.deadline: float | None = None
        self.num_cached_tokens = -1
        self.num_remote_cached_tokens = 0
        self.num_preemptions = 0
        total_blocks = (spec.prompt_len + spec.output_len) // block_tokens
        tail = -(spec.index << 24) - 1
        self.block_hashes = list(spec.block_hashes) + [
            tail - j for j in range(total_blocks - len(spec.block_hashes))
        ]
        # Set by the scheduler's waiting queue on first sight (its order key).
        self._queue_key: tuple | None = None
        self.replica: str | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []
        self.stop_after = spec.output_len

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

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
        """Traces carry no prompt-logprob requests: every request may hit the cache."""
        return False

    def set_status(self, status: RequestStatus) -> None:
        self.status = status


class SimReplica:
    """A replica's scheduler state and step timing. The cluster drives it: ``add`` requests,
    ``start_step`` (returns the step's duration, or None when idle), ``finish_step`` at the end.

    Invariant: ``current`` is the step in progress (None when idle); ``busy_s`` sums the durations
    of started steps.
    """

    def __init__(
        self,
        replica_id: str,
        *,
        cost: StepCost,
        capacity_blocks: int,
        block_tokens: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        watermark: float,
    ) -> None:
        self.replica_id = replica_id
        self.cost = cost
        self.block_tokens = block_tokens
        config = EngineConfig(
            model="simulated",
            block_size=block_tokens,
            num_kv_blocks=capacity_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            watermark=watermark,
        )
        self.kv = KVCacheManager(capacity_blocks, block_tokens, True, watermark)
        self.scheduler = Scheduler(config, self.kv, _MAX_MODEL_LEN)
        self.current: SchedulerOutput | None = None
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_routed = 0
        self.num_importing = 0  # routed here, fetching KV before joining the queue
        self.changed = True  # anything happened since the last report
        # A snapshot asked for during a step: taken when the step ends, if by this time.
        self.snapshot_due: float | None = None

    # -- requests ----------------------------------------------------------------------------
    def fits(self, request: SimRequest) -> bool:
        """Whether the request can ever be admitted: the engine rejects prompts that need more
        blocks than it has, and admission keeps the watermark free."""
        needed = cdiv(request.num_prompt_tokens + request.output_len, self.block_tokens)
        return needed <= self.kv.num_blocks - self.kv.watermark_blocks

    def add(self, request: SimRequest) -> None:
        self.scheduler.add_request(request)
        self.changed = True

    @property
    def num_ongoing(self) -> int:
        """Requests on the replica: running, waiting, or still importing KV (Serve's queue length)."""
        return len(self.scheduler.requests) + self.num_importing

    @property
    def idle(self) -> bool:
        return self.current is None

    # -- steps -------------------------------------------------------------------------------
    def start_step(self) -> float | None:
        """Schedule the next step; returns its duration, or None if there is nothing to run."""
        out = self.scheduler.schedule()
        while out.is_empty and out.preempted:
            out = self.scheduler.schedule()  # the engine simply tries again on its next loop
        if out.is_empty:
            return None
        prefill_tokens = 0
        pairs = 0.0
        decodes = 0
        decode_ctx = 0
        for request, n in out.scheduled:
            done = request.num_computed_tokens
            if n == 1 and request.num_output_tokens and done == request.num_tokens - 1:
                decodes += 1
                decode_ctx += done + 1
            else:
                prefill_tokens += n
                pairs += n * (done + (n + 1) / 2)
        duration = self.cost.step_s(prefill_tokens, pairs, decodes, decode_ctx)
        self.current = out
        self.busy_s += duration
        self.num_steps += 1
        self.changed = True
        return duration

    def finish_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply the step in progress, ending at ``now`` (each token produced is timed then):
        returns (requests that produced their first token, requests that finished)."""
        out = self.current
        assert out is not None, "no step in progress"
        self.current = None
        first: list[SimRequest] = []
        finished: list[SimRequest] = []
        for request in self.scheduler.update_from_output(out):
            request.num_output_tokens += 1
            request.token_times.append(now)
            if request.num_output_tokens == 1:
                first.append(request)
            if request.num_output_tokens >= request.stop_after:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
        return first, finished

    # -- KV sharing ----------------------------------------------------------------------------
    def local_prefix_blocks(self, hashes: list[int] | tuple[int, ...]) -> int:
        cached = self.kv.pool.cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def held_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` cached here and held by an admitted request (a request
        with that prefix shares them instead of taking free blocks)."""
        pool = self.kv.pool
        n = 0
        for h in hashes:
            block = pool.get_cached_block(h)
            if block is None or block.ref_cnt <= 0:
                break
            n += 1
        return n

    def kv_signals(self, hashes: list[int] | tuple[int, ...] | Sequence[int]) -> KVSignals:
        """What Dynamo's KV events and lifecycle hooks tell its router about this replica, read
        exactly at ``now``: blocks held by admitted requests plus the prompt blocks of requests
        not admitted yet (Dynamo books those when it routes them), and tokens still to prefill."""
        pool = self.kv.pool
        shared = self.held_prefix_blocks(hashes)
        bt = self.block_tokens
        queued = sum(
            -(-r.num_tokens // bt)
            for r in self.scheduler.requests.values()
            if r.status != RequestStatus.RUNNING
        )
        return KVSignals(
            overlap_blocks=self.local_prefix_blocks(hashes),
            active_blocks=pool.num_blocks - pool.num_free_blocks + queued,
            shared_active_blocks=shared,
            active_prefill_tokens=self.scheduler.num_pending_prefill_tokens,
        )

    def install(self, hashes: list[int]) -> int:
        """Install imported blocks as free cached blocks, as ``engine.kv_transfer.import_blocks``
        does: blocks already cached are skipped, nothing is installed when the pool cannot spare
        the rest above the watermark, and the run is freed in reverse so its head is evicted
        last. Returns how many blocks were installed."""
        pool = self.kv.pool
        missing = [h for h in hashes if pool.get_cached_block(h) is None]
        if not missing or len(missing) > pool.num_free_blocks - self.kv.watermark_blocks:
            return 0
        blocks = pool.allocate(len(missing))
        for block, h in zip(blocks, missing, strict=True):
            pool.cache_block(block, h)
        pool.free(reversed(blocks))
        self.changed = True
        return len(missing)

    # -- reports -------------------------------------------------------------------------------
    def report(self, now: float) -> dict[str, object]:
        """The routing-stats dict an engine replica returns from ``record_routing_stats()``."""
        pool = self.kv.pool
        self.changed = False
        return {
            "replica_id": self.replica_id,
            "started_at": 0.0,
            "block_size": self.block_tokens,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_pending_prefill_tokens": self.scheduler.num_pending_prefill_tokens,
            "kv_free_blocks": pool.num_free_blocks,
            "kv_total_blocks": pool.num_blocks,
            "cached_block_hashes": pool.cached_hashes(),
            "reported_at": now,
        }
