"""The discrete-event loop: arrivals routed by the real policy, replicas stepping, periodic reports.

Events live in one ``heapq`` keyed by ``(time, sequence number)``, so equal times keep insertion
order and a run is deterministic for a seed. Four kinds:

- ``ARRIVAL``: the router ranks the replicas with ``policy.rank`` (block hashes of the prompt, the
  KV directory's hashes with KV sharing), takes the first replica below ``max_ongoing_requests``
  (as Serve does; if all are full the request waits for the next completion), then calls
  ``on_request_routed`` and ``observe_load`` with the replica's new queue length, as the Serve
  adapter does when a replica accepts a request. With KV sharing the replica may first import
  blocks (an ``IMPORT`` event after the transfer time); otherwise the request joins its queue.
- ``STEP``: a replica's step ends: tokens are appended, first tokens and completions recorded
  (``on_request_completed``), the next step scheduled at once if there is work.
- ``IMPORT``: imported blocks are installed and the request joins the replica's queue.
- ``REPORT``: every ``stats_period_s`` the router asks each replica for its routing stats (the
  dict ``record_routing_stats()`` returns, fed to ``policy.apply_report``). As a live replica
  takes its snapshot on the engine thread between steps (``AsyncEngine.call``), an idle
  replica reports at once and a stepping one when its step in progress ends (at that ``STEP``
  event, after its tokens and completions, before the next step starts), stamped with that
  time. If that step ends more than ``SNAPSHOT_TIMEOUT_S`` after the request, the snapshot is
  dropped, as the live request times out and the router keeps the previous report. A replica
  where nothing happened since its last report is skipped: its report would repeat the last one.

Nodes: with ``replicas_per_node`` set, replica ``i`` runs on node ``i // replicas_per_node``; its
reports carry its node id and the transfer cost ratios a live replica measures (from the
profile), the router's directory hint names the nodes blocks were published on, and blocks
imported from another node take the profile's cross-node time. Unset, the cluster has no nodes
and runs exactly as before nodes were modelled.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.sim.profile import Profile
from benchmarks.sim.ray_policies import PORTS, RayKVAwarePolicy, make_port
from benchmarks.sim.replica import SimReplica, SimRequest
from benchmarks.sim.sharing import SimDirectory
from benchmarks.sim.trace import SimRequestSpec
from router import make_policy

ARRIVAL, STEP, IMPORT, REPORT = 0, 1, 2, 3

# How long a live router waits for a replica's snapshot (``record_routing_stats`` in
# deployments/engine_replica.py) before it keeps the previous one.
SNAPSHOT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ClusterConfig:
    """One simulated cluster. ``directory_capacity_blocks=None`` gives the KV directory the
    cluster's total KV capacity (the live default: 2 GiB of directory for two 1 GiB replicas)."""

    replicas: int
    capacity_blocks: int
    policy: str = "prefix_aware"
    router_config: Mapping[str, Any] = field(default_factory=dict)
    block_tokens: int = 16
    stats_period_s: float = 1.0
    kv_sharing: bool = False
    directory_capacity_blocks: int | None = None
    kv_min_blocks: int = 4
    directory_hint: bool = True
    max_ongoing_requests: int = 256
    seed: int = 0
    replicas_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.capacity_blocks < 1 or self.block_tokens < 1:
            raise ValueError("replicas, capacity_blocks and block_tokens must be >= 1")
        if self.replicas_per_node is not None and self.replicas_per_node < 1:
            raise ValueError(f"replicas_per_node: must be >= 1, got {self.replicas_per_node}")
        if self.stats_period_s <= 0:
            raise ValueError(f"stats_period_s: must be > 0, got {self.stats_period_s}")


@dataclass
class ClusterRun:
    """What a run produced: every request (finished ones have ``finish_time``), the replicas,
    the policy (for its counters), and run statistics."""

    requests: list[SimRequest]
    rejected: list[SimRequest]
    replicas: list[SimReplica]
    policy: Any
    directory: SimDirectory | None
    num_events: int
    wall_s: float


class Cluster:
    def __init__(self, profile: Profile, config: ClusterConfig) -> None:
        self.profile = profile
        self.config = config
        rng = random.Random(config.seed)
        if config.policy in PORTS:  # Ray's routers, ported (benchmarks/sim/ray_policies.py)
            self.policy = make_port(
                config.policy, dict(config.router_config), config.block_tokens, rng
            )
        else:
            self.policy = make_policy(config.policy, dict(config.router_config), rng=rng)
        width = len(str(config.replicas - 1))
        self.replicas = [
            SimReplica(
                f"replica-{i:0{width}d}",
                cost=profile.step,
                capacity_blocks=config.capacity_blocks,
                block_tokens=config.block_tokens,
                max_num_batched_tokens=profile.max_num_batched_tokens,
                max_num_seqs=profile.max_num_seqs,
                watermark=profile.watermark,
            )
            for i in range(config.replicas)
        ]
        self.by_id = {r.replica_id: r for r in self.replicas}
        # Each replica's node and what its reports add (empty: no nodes modelled).
        self.node_of: dict[str, str | None] = dict.fromkeys(self.by_id)
        self._topology: dict[str, dict[str, Any]] = {}
        per_node = config.replicas_per_node
        if per_node is not None:
            same, cross = profile.transfer_cost_ratios()
            for i, replica in enumerate(self.replicas):
                node = self.node_of[replica.replica_id] = f"node-{i // per_node}"
                self._topology[replica.replica_id] = {
                    "node_id": node,
                    "transfer_cost_ratio": same,
                    "cross_node_transfer_cost_ratio": cross,
                }
        # The replicas the router sees (reports, ranking): all of them unless a subclass says.
        self.routed = self.replicas
        self.replica_ids = [r.replica_id for r in self.replicas]
        self.policy.update_replicas(self.replica_ids)
        if isinstance(self.policy, RayKVAwarePolicy):
            self.policy.bind_signals(lambda rid, hashes: self.by_id[rid].kv_signals(hashes))
        # The ports also read the prompt's length (Ray matches text, not only full blocks).
        self._rank_prompt = getattr(self.policy, "rank_prompt", None)
        self.directory: SimDirectory | None = None
        if config.kv_sharing:
            capacity = config.directory_capacity_blocks or config.replicas * config.capacity_blocks
            self.directory = SimDirectory(capacity, config.kv_min_blocks)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._backlog: deque[SimRequest] = deque()

    # -- the loop ----------------------------------------------------------------------------
    def run(self, specs: Sequence[SimRequestSpec]) -> ClusterRun:
        started = time.perf_counter()
        bt = self.config.block_tokens
        requests = [SimRequest(spec, bt) for spec in specs]
        rejected = [r for r in requests if not self.replicas[0].fits(r)]
        accepted = [r for r in requests if self.replicas[0].fits(r)]
        heap = self._heap
        push, pop = heapq.heappush, heapq.heappop
        for request in accepted:
            push(heap, (request.arrival_time, next(self._seq), ARRIVAL, request))
        period = self.config.stats_period_s
        if accepted:
            push(heap, (accepted[0].arrival_time + period, next(self._seq), REPORT, None))
        remaining = len(accepted)
        policy = self.policy
        directory = self.directory
        num_events = 0
        while heap:
            now, _, kind, obj = pop(heap)
            num_events += 1
            if kind == STEP:
                first, finished = obj.finish_step(now)
                for request in first:
                    request.first_token_time = now
                    if directory is not None:
                        directory.publish(obj, request, self.node_of[obj.replica_id])
                remaining -= self._complete(obj, finished, now)
                due = obj.snapshot_due
                if due is not None:
                    obj.snapshot_due = None
                    if now <= due:
                        self._report(obj, now)
                self._start(obj, now)
                if finished and self._backlog:
                    self._drain_backlog(now)
            elif kind == ARRIVAL:
                self._route(obj, now)
            elif kind == IMPORT:
                replica, request, hashes = obj
                replica.num_importing -= 1
                request.num_remote_cached_tokens = replica.install(hashes) * bt
                replica.add(request)
                if replica.idle:
                    self._start(replica, now)
            elif kind == REPORT:
                for replica in self.routed:
                    if not replica.changed:
                        continue
                    if replica.idle:
                        self._report(replica, now)
                    elif replica.snapshot_due is None or replica.snapshot_due < now:
                        # Taken when the step in progress ends (an earlier request whose step
                        # outlasted its timeout was dropped: the next poll asks again).
                        replica.snapshot_due = now + SNAPSHOT_TIMEOUT_S
                if remaining > 0:
                    if not heap:
                        raise RuntimeError(f"simulation stalled with {remaining} requests left")
                    push(heap, (now + period, next(self._seq), REPORT, None))
            else:
                self._on_event(kind, obj, now)
        return ClusterRun(
            requests=accepted,
            rejected=rejected,
            replicas=self.replicas,
            policy=policy,
            directory=directory,
            num_events=num_events,
            wall_s=time.perf_counter() - started,
        )

    def _report(self, replica: SimReplica, now: float) -> None:
        """``replica``'s routing stats, taken at ``now``, to the router."""
        stats = replica.report(now)
        stats.update(self._topology.get(replica.replica_id, ()))
        self.policy.apply_report(replica.replica_id, stats, now)

    def _complete(self, replica: SimReplica, finished: list[SimRequest], now: float) -> int:
        """Requests ``replica`` finished at ``now``; returns how many trace requests completed."""
        for request in finished:
            request.finish_time = now
            self.policy.on_request_completed(request.request_id, now)
        return len(finished)

    def _on_event(self, kind: int, obj: Any, now: float) -> None:
        """An event kind a subclass added (the four above are handled in ``run``)."""
        raise ValueError(f"unknown event kind {kind}")

    def _start(self, replica: SimReplica, now: float) -> None:
        duration = replica.start_step()
        if duration is not None:
            heapq.heappush(self._heap, (now + duration, next(self._seq), STEP, replica))

    def _route(self, request: SimRequest, now: float) -> None:
        hashes = request.spec.block_hashes
        directory = self.directory
        hint: Any = None
        if directory is not None and self.config.directory_hint:
            hint = directory.located if self._topology else directory.hashes
        if self._rank_prompt is not None:
            ranks = self._rank_prompt(
                self.replica_ids, hashes, request.num_prompt_tokens, now, hint
            )
        else:
            ranks = self.policy.rank(self.replica_ids, hashes, now, hint)
        limit = self.config.max_ongoing_requests
        replica = next(
            (
                self.by_id[rid]
                for rank in ranks
                for rid in rank
                if self.by_id[rid].num_ongoing < limit
            ),
            None,
        )
        if replica is None:
            self._backlog.append(request)  # every replica is full: retry at the next completion
            return
        request.replica = replica.replica_id
        replica.num_routed += 1
        self.policy.on_request_routed(request.request_id, replica.replica_id, hashes, now)
        plan = directory.plan_import(replica, request) if directory is not None else []
        if plan:
            directory.imports += 1
            directory.imported_blocks += len(plan)
            replica.num_importing += 1
            replica.changed = True
            crossing = directory.cross_node_blocks(self.node_of[replica.replica_id], plan)
            directory.imported_cross_node_blocks += crossing
            at = now + self.profile.transfer_s(len(plan), self.config.block_tokens, crossing)
            heapq.heappush(self._heap, (at, next(self._seq), IMPORT, (replica, request, plan)))
        else:
            replica.add(request)
        self.policy.observe_load(replica.replica_id, replica.num_ongoing, now)
        if replica.idle:
            self._start(replica, now)

    def _drain_backlog(self, now: float) -> None:
        for _ in range(len(self._backlog)):
            self._route(self._backlog.popleft(), now)
