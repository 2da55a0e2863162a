"""What one router believes about each replica: cached block hashes and load.

Two sources feed it: the replicas' periodic reports (authoritative but up to a stats period old)
and this router's own decisions (fresh but only a guess at what the replica will cache). All
times are seconds on one clock shared with the reports' ``reported_at`` (``time.time()`` in a
deployment, the simulated clock in a simulator), and ``now`` never decreases between calls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.report import ReplicaReport

_NEVER = -math.inf


class ReplicaView:
    """One replica as seen by this router.

    Invariants:
      * ``cached`` is the hash set of the newest applied report (empty before the first).
      * ``own[h] == [pins, stamp]``: ``pins`` counts this router's in-flight requests on the replica
        whose prompt includes block ``h`` (their blocks are pinned there, so they count as cached);
        ``stamp`` is the time of the latest routing or completion touching ``h``. An entry with no
        pins counts as cached until ``stamp + decision_ttl_s`` and is dropped by the first report
        taken at or after ``stamp``, which is authoritative from then on.
      * ``inflight`` maps this router's unfinished requests on the replica to their routing times,
        in routing order.
      * ``unreported`` counts the in-flight requests routed after ``load_at`` (the time of the
        latest load figure, ``reported_load``); ``completed_since`` counts requests routed at or
        before ``load_at`` that completed after it.
      * ``inflight_prefill`` maps each of this router's in-flight requests to the prompt blocks it
        was expected to prefill (those not believed cached when it was routed);
        ``unreported_prefill`` sums them over the requests routed after ``report_at``, which the
        newest report's ``reported_prefill_blocks`` cannot include yet; ``reported_own_prefill``
        sums them over the others (routed at or before ``report_at``, not completed since), and
        ``foreign_prefill`` is the part of the report's figure those requests did not account
        for when it was applied (other routers' requests, or blocks this router wrongly believed
        cached).
    """

    __slots__ = (
        "replica_id",
        "started_at",
        "block_size",
        "num_running",
        "num_waiting",
        "kv_free_blocks",
        "kv_total_blocks",
        "cached",
        "report_at",
        "reported_load",
        "load_at",
        "own",
        "inflight",
        "unreported",
        "completed_since",
        "reported_prefill_blocks",
        "inflight_prefill",
        "unreported_prefill",
        "reported_own_prefill",
        "foreign_prefill",
        "transfer_cost_ratio",
        "cross_node_transfer_cost_ratio",
        "node_id",
        "decode_step_s",
        "intake_blocks",
        "_intake_log",
    )

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.started_at: float | None = None
        self.block_size: int | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.kv_free_blocks: int | None = None
        self.kv_total_blocks: int | None = None
        self.cached: frozenset[int] = frozenset()
        self.report_at = _NEVER
        self.reported_load = 0
        self.load_at = _NEVER
        self.own: dict[int, list[float]] = {}
        self.inflight: dict[str, float] = {}
        self.unreported = 0
        self.completed_since = 0
        self.reported_prefill_blocks = 0
        self.inflight_prefill: dict[str, int] = {}
        # Measured import-vs-prefill cost of a block on this replica (None: not measured yet).
        self.transfer_cost_ratio: float | None = None
        # The same for blocks published on another node, and this replica's node (None: unknown).
        self.cross_node_transfer_cost_ratio: float | None = None
        self.node_id: str | None = None
        # Recent seconds per decode step, with ``num_running`` sequences (None: nothing decodes).
        self.decode_step_s: float | None = None
        self.unreported_prefill = 0
        self.reported_own_prefill = 0
        self.foreign_prefill = 0
        # Blocks the replica's reports show it wrote into its cache (hashes new since the previous
        # report), in all, and as (previous report's time, report time, running total, blocks)
        # after each report that showed some, oldest first, trimmed to what
        # ``eviction_horizon`` needs: that report's blocks were written between the two times.
        self.intake_blocks = 0
        self._intake_log: deque[tuple[float, float, int, int]] = deque()

    @property
    def num_in_flight(self) -> int:
        """Requests this router sent to the replica that have not completed."""
        return len(self.inflight)

    @property
    def estimated_load(self) -> int:
        """Requests running or waiting on the replica now: the latest load figure, plus this
        router's requests routed since, minus its requests from before that completed since.
        Never below this router's own in-flight count."""
        estimate = self.reported_load + self.unreported - self.completed_since
        return max(estimate, len(self.inflight))

    @property
    def estimated_prefill_blocks(self) -> int:
        """Prompt blocks queued for prefill on the replica now: the newest report's figure plus the
        blocks of this router's requests routed since.

        A request of this router that completed since the report has certainly finished its
        prefill, so the report's figure is capped at what can still be queued: the expected
        prefill of this router's requests that it may include and that are still in flight, plus
        the part no such request accounted for (``foreign_prefill``). Without the cap a replica
        whose long prompt finished looks busy until its next report, and requests sharing a
        prefix with it leave it for a replica that must recompute the prefix. Requests still in
        flight that finished their prefill since the report still count until the next one (a
        report period at most): nothing tells this router when their first token came."""
        reported = min(
            self.reported_prefill_blocks, self.reported_own_prefill + self.foreign_prefill
        )
        return reported + self.unreported_prefill

    def holds(self, block_hash: int, now: float, decision_ttl_s: float) -> bool:
        """Whether the replica is believed to cache ``block_hash`` at ``now``."""
        if block_hash in self.cached:
            return True
        entry = self.own.get(block_hash)
        return entry is not None and (entry[0] > 0 or now - entry[1] < decision_ttl_s)

    def matched_blocks(self, block_hashes: Sequence[int], now: float, decision_ttl_s: float) -> int:
        """Length of the longest prefix of ``block_hashes`` believed cached here. Stops at the
        first miss: block i is only reusable if blocks 0..i-1 are too."""
        cached = self.cached
        own = self.own
        if not own:  # the common case between decisions: one set lookup per block
            for i, h in enumerate(block_hashes):
                if h not in cached:
                    return i
            return len(block_hashes)
        for i, h in enumerate(block_hashes):
            if h not in cached:
                entry = own.get(h)
                if entry is None or (entry[0] <= 0 and now - entry[1] >= decision_ttl_s):
                    return i
        return len(block_hashes)

    def add_intake(self, blocks: int, now: float, since: float = _NEVER) -> None:
        """The replica wrote ``blocks`` new blocks into its cache after ``since`` (its previous
        report; ``-inf``: unknown) and by ``now``."""
        if blocks <= 0:
            return
        self.intake_blocks += blocks
        log = self._intake_log
        log.append((since, now, self.intake_blocks, blocks))
        capacity = self.kv_total_blocks
        if capacity:
            # Entries at or below the horizon's running total are never read again.
            floor = self.intake_blocks - capacity
            while len(log) > 1 and log[0][2] <= floor:
                log.popleft()

    def eviction_key(self) -> tuple[bool, float]:
        """Orders replicas by how old the blocks are that new ones would evict (least harm
        first): a cache not yet full (or of unreported size) before a full one, and among those
        the fewer blocks written; a full cache by its ``eviction_horizon``, the earliest first."""
        capacity = self.kv_total_blocks
        written = self.intake_blocks
        if not capacity or written < capacity:
            return (False, float(written))
        return (True, self.eviction_horizon())

    def eviction_horizon(self) -> float:
        """How old the blocks are that new blocks would evict here, as far as the replica's
        reports tell: when the oldest of its latest KV capacity (``kv_total_blocks``) of
        written blocks was written. Each block written since pushed an older one out of the LRU
        cache, so earlier is better for a new prompt. A report says only that its new blocks
        were written since the previous report, so they are taken as written at an even pace
        in between: the *k*-th of *m* at ``k / m`` of the interval (the report's own time for
        the first report, whose interval is unknown). Rounding to the report's time instead
        would give every replica whose oldest block falls in the same report period the same
        horizon, however much of the period's writes came after it. ``-inf`` while the cache
        has not yet filled (or its size is not reported): new blocks evict nothing. A block
        reused since it was written moves to the young end of the LRU, which this ignores, so
        the oldest block is, if anything, older."""
        capacity = self.kv_total_blocks
        if not capacity or self.intake_blocks < capacity:
            return _NEVER
        floor = self.intake_blocks - capacity
        for since, written_at, total, blocks in self._intake_log:
            if total > floor:
                if since == _NEVER:
                    return written_at
                # The oldest block kept is write number floor + 1, the k-th of this report's.
                k = floor + 1 - (total - blocks)
                return since + (written_at - since) * k / blocks
        return _NEVER

    def set_load(self, load: int, at: float) -> None:
        self.reported_load = load
        self.load_at = at
        self.completed_since = 0
        unreported = 0
        # Routing times are non-decreasing in insertion order: count from the newest back.
        for routed_at in reversed(self.inflight.values()):
            if routed_at <= at:
                break
            unreported += 1
        self.unreported = unreported

    def set_prefill(self, pending_blocks: int) -> None:
        """A report taken at ``report_at`` says ``pending_blocks`` blocks await prefill."""
        self.reported_prefill_blocks = pending_blocks
        unreported = 0
        for request_id, routed_at in reversed(self.inflight.items()):
            if routed_at <= self.report_at:
                break
            unreported += self.inflight_prefill.get(request_id, 0)
        self.unreported_prefill = unreported
        self.reported_own_prefill = sum(self.inflight_prefill.values()) - unreported
        self.foreign_prefill = max(0, pending_blocks - self.reported_own_prefill)

    def drop_stale_decisions(self, now: float, decision_ttl_s: float, confirmed_at: float) -> None:
        """Forget unpinned decisions older than ``confirmed_at`` (a report's time) or the TTL."""
        stale = [
            h
            for h, (pins, stamp) in self.own.items()
            if pins <= 0 and (stamp <= confirmed_at or now - stamp >= decision_ttl_s)
        ]
        for h in stale:
            del self.own[h]


@dataclass(frozen=True, slots=True)
class _Request:
    replica_id: str
    block_hashes: tuple[int, ...]
    routed_at: float


class ClusterState:
    """Views of every known replica plus this router's in-flight requests. Deterministic: it reads
    no clock and draws no random numbers."""

    def __init__(self, decision_ttl_s: float) -> None:
        self.decision_ttl_s = decision_ttl_s
        self.views: dict[str, ReplicaView] = {}
        self._requests: dict[str, _Request] = {}
        self._next_prune_at = _NEVER

    def view(self, replica_id: str) -> ReplicaView:
        """The view of ``replica_id``, created empty on first use."""
        view = self.views.get(replica_id)
        if view is None:
            view = self.views[replica_id] = ReplicaView(replica_id)
        return view

    def sync_replicas(self, replica_ids: Iterable[str]) -> None:
        """Keep exactly these replicas; forget every other (removed or replaced) one."""
        keep = set(replica_ids)
        for replica_id in [r for r in self.views if r not in keep]:
            self.remove_replica(replica_id)
        for replica_id in keep:
            self.view(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        view = self.views.pop(replica_id, None)
        if view is not None:
            for request_id in view.inflight:
                self._requests.pop(request_id, None)

    def apply_report(self, replica_id: str, stats: Mapping[str, Any], now: float) -> bool:
        """Apply a replica's routing-stats dict; returns whether it changed the view.

        A report no newer than the last applied one is ignored; one with a different
        ``started_at`` means the replica restarted (a newer start) and its view is rebuilt from
        scratch, or that the report predates the restart (an older start) and is ignored.
        Raises ValueError when the dict breaks the contract (see ``router.report``).
        """
        view = self.views.get(replica_id)
        if (
            view is not None
            and stats.get("reported_at") == view.report_at
            and stats.get("started_at") == view.started_at
        ):
            return False  # the common case: the same snapshot seen again
        report = ReplicaReport.from_dict(stats)
        view = self.view(replica_id)
        if view.started_at is not None and report.started_at != view.started_at:
            if report.started_at < view.started_at:
                return False
            self.remove_replica(replica_id)
            view = self.view(replica_id)
        elif report.reported_at <= view.report_at:
            return False
        view.started_at = report.started_at
        view.block_size = report.block_size
        view.num_running = report.num_running
        view.num_waiting = report.num_waiting
        view.kv_free_blocks = report.kv_free_blocks
        view.kv_total_blocks = report.kv_total_blocks
        # Blocks written since the previous report (a prompt's, an answer's, an import's): the
        # hashes it did not list. The first report counts its whole cache as written then.
        view.add_intake(
            len(report.cached_block_hashes - view.cached), report.reported_at, view.report_at
        )
        view.cached = report.cached_block_hashes
        view.transfer_cost_ratio = report.transfer_cost_ratio
        view.cross_node_transfer_cost_ratio = report.cross_node_transfer_cost_ratio
        view.node_id = report.node_id
        view.decode_step_s = report.decode_step_s
        pending = -(-report.num_pending_prefill_tokens // max(1, report.block_size))
        view.report_at = report.reported_at
        view.set_prefill(pending)
        view.drop_stale_decisions(now, self.decision_ttl_s, report.reported_at)
        if report.reported_at >= view.load_at:
            view.set_load(report.load, report.reported_at)
        return True

    def observe_load(self, replica_id: str, num_requests: int, now: float) -> None:
        """A fresher load figure than the last report: ``num_requests`` running or waiting on the
        replica at ``now``, including every request routed to it up to ``now``."""
        view = self.view(replica_id)
        if now >= view.load_at:
            view.set_load(max(0, int(num_requests)), now)

    def on_request_routed(
        self, request_id: str, replica_id: str, block_hashes: Sequence[int], now: float
    ) -> None:
        """Record that ``request_id`` (prompt blocks ``block_hashes``) went to ``replica_id``."""
        if request_id in self._requests:
            self.on_request_completed(request_id, now)  # re-routed: the first attempt is over
        view = self.view(replica_id)
        hashes = tuple(block_hashes)
        self._requests[request_id] = _Request(replica_id, hashes, now)
        view.inflight[request_id] = now
        if now > view.load_at:
            view.unreported += 1
        uncached = len(hashes) - view.matched_blocks(hashes, now, self.decision_ttl_s)
        view.inflight_prefill[request_id] = uncached
        if now > view.report_at:
            view.unreported_prefill += uncached
        own = view.own
        for h in hashes:
            entry = own.get(h)
            if entry is None:
                own[h] = [1, now]
            else:
                entry[0] += 1
                entry[1] = now
        self._maybe_prune(now)

    def on_request_completed(self, request_id: str, now: float) -> bool:
        """Record that ``request_id`` finished (in any way); False if it was not in flight here."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        view = self.views.get(request.replica_id)
        routed_at = None if view is None else view.inflight.pop(request_id, None)
        if view is None or routed_at is None:
            return True
        if routed_at > view.load_at:
            view.unreported -= 1
        else:
            view.completed_since += 1
        uncached = view.inflight_prefill.pop(request_id, 0)
        if routed_at > view.report_at:
            view.unreported_prefill -= uncached
        else:
            view.reported_own_prefill -= uncached
        own = view.own
        for h in request.block_hashes:
            entry = own.get(h)
            if entry is not None:
                entry[0] = max(0, entry[0] - 1)
                entry[1] = max(entry[1], now)
        return True

    def in_flight(self, request_id: str) -> str | None:
        """The replica ``request_id`` is in flight on, if any."""
        request = self._requests.get(request_id)
        return None if request is None else request.replica_id

    def _maybe_prune(self, now: float) -> None:
        # Without reports (stats disabled or failing) expired decisions would pile up: sweep them
        # a few times per TTL, which keeps the amortised cost per request constant.
        if now < self._next_prune_at:
            return
        self._next_prune_at = now + self.decision_ttl_s / 4
        for view in self.views.values():
            view.drop_stale_decisions(now, self.decision_ttl_s, _NEVER)
