"""Prefill/decode disaggregation in the simulator: prompts on prefill replicas, decodes elsewhere.

The cluster's first ``prefill`` replicas run only prompts; the others only decodes. A request:

1. arrives and is routed among the prefill replicas by the configured policy, exactly as in the
   colocated cluster (prefix cache, queued prefill, load; KV sharing imports if enabled);
2. runs there until its first token (``stop_after = 1``): TTFT ends at that step, as the live
   Prefill deployment returns the first token with the prompt's KV. If the request wanted only
   one token it is done;
3. otherwise it is handed off: it waits until a decode replica can hold it (below), then after
   ``profile.transfer_s(blocks)`` for the prompt's full blocks that replica does not already
   cache (the engine's measured fetch cost per block, the figure KV sharing uses) those blocks
   are installed there as free cached blocks (the blocks it already held stay pinned meanwhile,
   so neither the wait nor the install's allocation evicts them) and a continuation joins
   the replica's queue: prompt plus first token as its prompt, the remaining tokens as output.
   Its prefix hit covers every full prompt block, so it computes only the partial last block and
   the first token before decoding.

Decode placement. A handoff goes to the decode replica with the fewest requests on it (running,
waiting or still fetching), ties to the one caching more of the prompt's leading blocks, then
replica order; only replicas below ``max_ongoing_requests`` whose KV can hold the request's whole
footprint (``cdiv(prompt + output, block)`` blocks, less leading blocks already held by running
requests) beside the footprints already placed there, above the watermark. When no replica can,
handoffs wait in arrival order (the first one that does not fit holds the others back) and are
retried when a decode replica finishes a request. Reserving whole footprints means a decode
replica never preempts for lack of blocks, as a decode pool sized by admission would.

Not modelled: the prefill replica's export of the blocks into Ray's object store (live, done in
the background) and the handoff's RPC; both are charged to nobody.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.sim.cluster import Cluster, ClusterConfig, ClusterRun
from benchmarks.sim.metrics import distribution_ms
from benchmarks.sim.profile import Profile
from benchmarks.sim.replica import SimReplica, SimRequest
from benchmarks.sim.trace import SimRequestSpec
from engine.block_pool import KVCacheBlock
from engine.kv_cache_manager import cdiv

HANDOFF = 4  # an event kind beside cluster.py's four: a handed-off request reaches its decoder


@dataclass
class Handoff:
    """One request's move from its prefill replica to a decode replica (times on the simulated
    clock). ``ready_at`` is its first token; ``placed_at`` when a decode replica accepted it (the
    transfer starts); ``joined_at`` when the blocks are installed and it joins that replica's
    queue. ``blocks`` counts blocks transferred; ``reserved`` the KV blocks booked for it."""

    request: SimRequest
    ready_at: float
    decode_replica: str | None = None
    placed_at: float | None = None
    joined_at: float | None = None
    blocks: int = 0
    reserved: int = 0
    continuation: SimRequest | None = None
    pinned: list[KVCacheBlock] = field(default_factory=list)  # held until the install


@dataclass
class DisaggregatedRun(ClusterRun):
    """A run of a disaggregated cluster: the prefill and decode replica ids and every handoff."""

    prefill_ids: list[str] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    install_failures: int = 0


def continuation(request: SimRequest, block_tokens: int) -> SimRequest:
    """The request as its decode replica receives it: the prompt plus the first token as prompt,
    the remaining tokens as output. Block hashes (the prompt's, then the request's own unique
    tail ids) are the original's, so the prompt's blocks hit; token times are shared, so the
    decoder's tokens extend the record's."""
    spec = request.spec
    tail = replace(spec, prompt_len=spec.prompt_len + 1, output_len=spec.output_len - 1)
    cont = SimRequest(tail, block_tokens)
    cont.token_times = request.token_times
    return cont


class DisaggregatedCluster(Cluster):
    """A cluster of ``prefill`` prefill replicas and ``config.replicas - prefill`` decode
    replicas (see the module docstring). The router sees only the prefill replicas."""

    def __init__(self, profile: Profile, config: ClusterConfig, prefill: int) -> None:
        if not 1 <= prefill < config.replicas:
            raise ValueError(
                f"disaggregated: prefill replicas must be in [1, {config.replicas - 1}] "
                f"(out of {config.replicas}), got {prefill}"
            )
        super().__init__(profile, config)
        self.prefill = self.replicas[:prefill]
        self.decode = self.replicas[prefill:]
        self._is_prefill = {id(r) for r in self.prefill}
        self.routed = self.prefill
        self.replica_ids = [r.replica_id for r in self.prefill]
        self.policy.update_replicas(self.replica_ids)
        self._committed = {r.replica_id: 0 for r in self.decode}
        self._waiting: deque[Handoff] = deque()
        self._handoffs: list[Handoff] = []
        self._of_continuation: dict[int, Handoff] = {}
        self._install_failures = 0

    def run(self, specs: Sequence[SimRequestSpec]) -> DisaggregatedRun:
        base = super().run(specs)
        return DisaggregatedRun(
            **vars(base),
            prefill_ids=[r.replica_id for r in self.prefill],
            decode_ids=[r.replica_id for r in self.decode],
            handoffs=self._handoffs,
            install_failures=self._install_failures,
        )

    # -- the cluster's hooks ---------------------------------------------------------------------
    def _route(self, request: SimRequest, now: float) -> None:
        request.stop_after = 1  # the prefill replica stops at the first token
        super()._route(request, now)

    def _complete(self, replica: SimReplica, finished: list[SimRequest], now: float) -> int:
        done = 0
        if id(replica) in self._is_prefill:
            for request in finished:
                self.policy.on_request_completed(request.request_id, now)
                if request.num_output_tokens >= request.output_len:
                    request.finish_time = now
                    done += 1
                else:
                    handoff = Handoff(request, ready_at=now)
                    self._handoffs.append(handoff)
                    self._waiting.append(handoff)
        else:
            for cont in finished:
                handoff = self._of_continuation.pop(id(cont))
                request = handoff.request
                request.num_output_tokens += cont.num_output_tokens
                request.num_preemptions += cont.num_preemptions
                request.finish_time = now
                self._committed[replica.replica_id] -= handoff.reserved
                done += 1
        if self._waiting:
            self._place_waiting(now)
        return done

    def _on_event(self, kind: int, obj: Any, now: float) -> None:
        if kind != HANDOFF:
            super()._on_event(kind, obj, now)
            return
        replica, handoff = obj
        replica.num_importing -= 1
        if not _install_prompt(replica, handoff):
            self._install_failures += 1  # no room: the decoder recomputes what is missing
        cont = continuation(handoff.request, self.config.block_tokens)
        handoff.continuation = cont
        handoff.joined_at = now
        self._of_continuation[id(cont)] = handoff
        replica.add(cont)
        replica.changed = True
        if replica.idle:
            self._start(replica, now)

    # -- decode placement ------------------------------------------------------------------------
    def _place_waiting(self, now: float) -> None:
        while self._waiting:
            handoff = self._waiting[0]
            choice = self._pick_decode(handoff.request)
            if choice is None:
                return  # in order: the head waits for a decode replica to finish something
            self._waiting.popleft()
            replica, reserved = choice
            self._place(handoff, replica, reserved, now)

    def _pick_decode(self, request: SimRequest) -> tuple[SimReplica, int] | None:
        """The decode replica for ``request`` and the blocks to reserve there, or None."""
        bt = self.config.block_tokens
        footprint = cdiv(request.num_prompt_tokens + request.output_len, bt)
        hashes = request.spec.block_hashes
        limit = self.config.max_ongoing_requests
        best: tuple[int, int, int] | None = None
        choice: tuple[SimReplica, int] | None = None
        for i, replica in enumerate(self.decode):
            if replica.num_ongoing >= limit:
                continue
            held = replica.held_prefix_blocks(hashes)
            reserved = footprint - held
            room = replica.kv.num_blocks - replica.kv.watermark_blocks
            if self._committed[replica.replica_id] + reserved > room:
                continue
            key = (replica.num_ongoing, -replica.local_prefix_blocks(hashes), i)
            if best is None or key < best:
                best, choice = key, (replica, reserved)
        return choice

    def _place(self, handoff: Handoff, replica: SimReplica, reserved: int, now: float) -> None:
        hashes = handoff.request.spec.block_hashes
        pool = replica.kv.pool
        cached = [b for b in map(pool.get_cached_block, hashes) if b is not None]
        # Pinned until the rest arrives: neither the transfer's wait nor the install's own
        # allocation may evict what the replica already holds.
        pool.touch(cached)
        handoff.pinned = cached
        blocks = len(hashes) - len(cached)
        handoff.decode_replica = replica.replica_id
        handoff.placed_at = now
        handoff.blocks = blocks
        handoff.reserved = reserved
        self._committed[replica.replica_id] += reserved
        replica.num_routed += 1
        replica.num_importing += 1
        replica.changed = True
        at = now + self.profile.transfer_s(blocks, self.config.block_tokens)
        heapq.heappush(self._heap, (at, next(self._seq), HANDOFF, (replica, handoff)))


def _install_prompt(replica: SimReplica, handoff: Handoff) -> bool:
    """Install the prompt's full blocks the replica lacks as cached blocks, then release them
    with the pinned ones, last block first, so that the prompt's head is evicted last (as
    ``SimReplica.install`` orders an import). All or nothing, as the engine's import: False when
    the pool cannot spare the missing blocks above the watermark."""
    pool = replica.kv.pool
    hashes = handoff.request.spec.block_hashes
    missing = [h for h in hashes if pool.get_cached_block(h) is None]
    ok = len(missing) <= pool.num_free_blocks - replica.kv.watermark_blocks
    mine = {block.block_hash: block for block in handoff.pinned}
    if ok and missing:
        for block, h in zip(pool.allocate(len(missing)), missing, strict=True):
            pool.cache_block(block, h)
            mine[h] = block
    # One reference each, the pin or the allocation; blocks another import installed meanwhile
    # are not ours to release.
    pool.free(reversed([mine[h] for h in hashes if h in mine]))
    handoff.pinned = []
    return ok


def make_cluster(profile: Profile, config: ClusterConfig, prefill: int = 0) -> Cluster:
    """A colocated cluster, or with ``prefill`` > 0 a disaggregated one."""
    if prefill:
        return DisaggregatedCluster(profile, config, prefill)
    return Cluster(profile, config)


def summarize_disaggregation(run: DisaggregatedRun, makespan_s: float) -> dict[str, Any]:
    """The handoffs of a run: how many, blocks moved, how long they waited for a decode replica
    and travelled, and each pool's utilisation over the makespan."""
    placed = [h for h in run.handoffs if h.placed_at is not None and h.joined_at is not None]
    by_id = {r.replica_id: r for r in run.replicas}

    def utilization(ids: list[str]) -> float:
        if makespan_s <= 0 or not ids:
            return 0.0
        return sum(by_id[i].busy_s for i in ids) / (len(ids) * makespan_s)

    return {
        "prefill_replicas": len(run.prefill_ids),
        "decode_replicas": len(run.decode_ids),
        "handoffs": len(run.handoffs),
        "transferred_blocks": sum(h.blocks for h in placed),
        "install_failures": run.install_failures,
        "handoff_wait_ms": distribution_ms([h.placed_at - h.ready_at for h in placed]),  # type: ignore[operator]
        "handoff_transfer_ms": distribution_ms([h.joined_at - h.placed_at for h in placed]),  # type: ignore[operator]
        "prefill_utilization": utilization(run.prefill_ids),
        "decode_utilization": utilization(run.decode_ids),
    }
