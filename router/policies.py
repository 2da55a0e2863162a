"""Routing policies behind one interface: feed them reports and decisions, ask them for a ranking.

A policy never reads a clock, never awaits and draws random numbers only from its own
``random.Random``, so a simulator that passes ``now`` and a seeded generator replays exactly.
``rank`` returns ranks as Ray Serve's ``RequestRouter.choose_replicas`` does: a list of lists of
replica ids, best first. These policies return every candidate, one per rank, so a caller that
finds its first choice full moves on to the next without asking again.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from router.affinity import PrefixHeat, SessionTable, prefix_home, session_home
from router.config import RouterConfig
from router.report import report_sessions
from router.state import ClusterState, ReplicaView
from router.topology import remote_block_counts, transfer_weights

Ranks = list[list[str]]


class RoutingPolicy(ABC):
    """State hooks shared by every policy, plus the abstract ``rank``.

    ``counters`` counts ranking outcomes by kind (policy specific) for metrics and simulations.
    """

    name: ClassVar[str]

    def __init__(self, config: RouterConfig | None = None, *, rng: random.Random | None = None):
        self.config = config if config is not None else RouterConfig()
        self.rng = rng if rng is not None else random.Random()
        self.state = ClusterState(self.config.decision_ttl_s)
        self.counters: dict[str, int] = {}
        # The kind of the latest ranking (a key of ``counters``): why its first choice won.
        self.last_outcome: str | None = None

    # -- state hooks ------------------------------------------------------------------------

    def update_replicas(self, replica_ids: Iterable[str]) -> None:
        """The replica set changed: forget every replica not in ``replica_ids``."""
        self.state.sync_replicas(replica_ids)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica (it died or was removed) and this router's requests on it."""
        self.state.remove_replica(replica_id)

    def apply_report(self, replica_id: str, report: Mapping[str, Any], now: float) -> bool:
        """Feed a routing-stats dict (see ``router.report``); True if it changed the view."""
        return self.state.apply_report(replica_id, report, now)

    def observe_load(self, replica_id: str, num_requests: int, now: float) -> None:
        """Feed a fresher load figure: requests on the replica at ``now``, counting every request
        routed to it up to ``now`` (e.g. Serve's queue length from an accepted request)."""
        self.state.observe_load(replica_id, num_requests, now)

    def on_request_routed(
        self,
        request_id: str,
        replica_id: str,
        block_hashes: Sequence[int],
        now: float,
        *,
        session: str | None = None,
    ) -> None:
        """This router sent ``request_id`` (a turn of ``session``, if given) to ``replica_id``:
        count its load and treat its prompt blocks as cached there (see ``ReplicaView`` for how
        long)."""
        self.state.on_request_routed(request_id, replica_id, block_hashes, now)

    def on_request_completed(self, request_id: str, now: float) -> None:
        """``request_id`` finished, failed or was cancelled. Unknown ids are ignored."""
        self.state.on_request_completed(request_id, now)

    def view(self, replica_id: str) -> ReplicaView | None:
        return self.state.views.get(replica_id)

    # -- ranking ----------------------------------------------------------------------------

    @abstractmethod
    def rank(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None = None,
        *,
        session: str | None = None,
    ) -> Ranks:
        """Rank ``candidates`` for a request whose prompt has chained block hashes
        ``block_hashes`` (may be empty: no prefix information). ``directory_hashes``, if given,
        holds (at least) those of the request's hashes the shared KV directory can supply; a
        ``router.topology.BlockLocations`` also says which nodes published them.
        ``session`` names the conversation the request belongs to, if the client said."""

    def _count(self, kind: str) -> None:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        self.last_outcome = kind

    def _power_of_two(
        self, candidates: Sequence[str], loads: Sequence[float] | None = None
    ) -> Ranks:
        """Two distinct random candidates, the less loaded first, then the rest by load.
        ``loads`` (per candidate) defaults to the estimated request counts."""
        if loads is None:
            loads = [self.state.view(r).estimated_load for r in candidates]
        if len(candidates) <= 1:
            return [[r] for r in candidates]
        i, j = self.rng.sample(range(len(candidates)), 2)
        if loads[j] < loads[i]:
            i, j = j, i
        rest = sorted(
            (k for k in range(len(candidates)) if k != i and k != j), key=loads.__getitem__
        )
        return [[candidates[k]] for k in (i, j, *rest)]


class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the candidates (sorted by id, so the order does not depend on the caller)."""

    name = "round_robin"

    def __init__(self, config: RouterConfig | None = None, *, rng: random.Random | None = None):
        super().__init__(config, rng=rng)
        self._next = self.rng.randrange(1 << 30)

    def rank(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None = None,
        *,
        session: str | None = None,
    ) -> Ranks:
        ordered = sorted(candidates)
        if not ordered:
            return []
        start = self._next % len(ordered)
        self._next += 1
        self._count("round_robin")
        return [[r] for r in ordered[start:] + ordered[:start]]


class PowerOfTwoPolicy(RoutingPolicy):
    """Power of two choices on this router's load estimate; ignores prefixes."""

    name = "power_of_two"

    def rank(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None = None,
        *,
        session: str | None = None,
    ) -> Ranks:
        self._count("power_of_two")
        return self._power_of_two(candidates)


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """How the prefix-aware cost came out for one candidate (all counts in blocks / requests)."""

    replica_id: str
    matched_blocks: int  # leading blocks believed cached on the replica (reports, own decisions,
    # and for the session's replica its previous prompt)
    transfer_blocks: int  # following blocks the KV directory can supply
    uncached_blocks: int  # the rest, to be prefilled (hot-prefix blocks not included)
    load: int  # estimated requests running or waiting
    queued_prefill_blocks: int  # estimated prompt blocks awaiting prefill ahead of this request
    cost: float
    hot: bool  # load tripped the imbalance guard
    replicate_blocks: int = 0  # blocks of a hot prefix this replica would be a new holder of
    session: bool = False  # the replica the request's session was last sent to
    cross_node_blocks: int = 0  # of transfer_blocks, those published on other nodes only


# Indices into the per-candidate term tuples (the hot path builds no objects).
_MATCHED, _TRANSFER, _LOAD, _QUEUED, _COST, _HOT, _REPLICATE, _SESSION = 1, 2, 4, 5, 6, 7, 8, 9


class PrefixAwarePolicy(RoutingPolicy):
    """Least cost first, where cost = prefill work the replica's cache does not cover + load.

    * If no candidate holds at least ``min_match_blocks`` leading blocks of the request and the
      request names no session, this router knows of no affinity to exploit; another router of
      the deployment may have sent the same prefix somewhere already. The request goes to the
      ``prefix_home`` of its first block unless that replica's load cost exceeds the least by
      more than one request's (counted as ``prefix_home``), else by power of two choices on
      the load terms of the cost (``fallback``). With ``min_match_blocks=0`` this never happens
      and a request without matches goes to the candidate with the least load cost.
    * Otherwise candidates are ranked by ``CandidateScore.cost``; ties go to the session's
      replica, then at random.
    * Session affinity: the replica a session's latest turn went to is priced as holding that
      turn's prompt blocks (the router cannot see the answer it cached, nor a prompt whose early
      tokens changed), so a turn returns there unless load outweighs the reuse (``session``
      counts first choices that are the session's replica). A session this router has not seen
      (new, or routed by another router of the same deployment) has its ``session_home`` as its
      replica, unpriced: it wins ties, so routers that share no memory still agree (counted as
      ``session_home``).
    * Hot prefixes: when the longest match is asked for often (``PrefixHeat``) and fewer replicas
      hold it than its rate wants, non-holders price its blocks at ``hot_prefix_cost_per_block``,
      so a loaded holder gives requests to a second replica (counted as ``replicate``).
    * Imbalance guard: candidates whose load exceeds the least-loaded candidate's by more than
      ``imbalance_abs`` and by a factor above ``imbalance_rel`` are ranked after all others, so a
      hot prefix cannot pile onto its holder while other replicas idle (counted as ``guarded``
      when it changed the first choice; otherwise ``prefix``).
    """

    name = "prefix_aware"

    def __init__(self, config: RouterConfig | None = None, *, rng: random.Random | None = None):
        super().__init__(config, rng=rng)
        cfg = self.config
        self.sessions = SessionTable(cfg.session_capacity)
        self.heat = PrefixHeat(cfg.hot_prefix_capacity, cfg.hot_prefix_window_s)

    def apply_report(self, replica_id: str, report: Mapping[str, Any], now: float) -> bool:
        """As the base class; a session the report says the replica served, and this router has
        no memory of, is remembered there (another router routed it)."""
        sessions = report_sessions(report)
        changed = super().apply_report(replica_id, report, now)
        if changed:
            for session, blocks in sessions:
                if self.sessions.get(session) is None:
                    self.sessions.record(session, replica_id, blocks)
        return changed

    def on_request_routed(
        self,
        request_id: str,
        replica_id: str,
        block_hashes: Sequence[int],
        now: float,
        *,
        session: str | None = None,
    ) -> None:
        super().on_request_routed(request_id, replica_id, block_hashes, now)
        if session is not None:
            self.sessions.record(session, replica_id, len(block_hashes))

    def score(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None = None,
        *,
        session: str | None = None,
    ) -> list[CandidateScore]:
        """The cost terms of every candidate, in candidate order (counts no request as heat)."""
        return [
            CandidateScore(*terms)
            for terms in self._cost_terms(
                candidates, block_hashes, now, directory_hashes, session, count=False
            )
        ]

    def rank(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None = None,
        *,
        session: str | None = None,
    ) -> Ranks:
        if not candidates:
            return []
        terms = self._cost_terms(
            candidates, block_hashes, now, directory_hashes, session, count=True
        )
        has_session = any(t[_SESSION] for t in terms)
        if not has_session and max(t[_MATCHED] for t in terms) < self.config.min_match_blocks:
            cfg = self.config
            loads = [
                cfg.load_cost_per_request * t[_LOAD]
                + cfg.queued_prefill_cost_per_block * t[_QUEUED]
                for t in terms
            ]
            if cfg.evict_oldest:
                return self._evict_oldest(candidates, loads)
            home = (
                prefix_home(block_hashes[0], candidates)
                if block_hashes and cfg.prefix_home
                else None
            )
            if home is not None:
                i = candidates.index(home)
                # One request of slack: within it, meeting the requests other routers sent with
                # the same first block is worth more than the load difference.
                if loads[i] <= min(loads) + cfg.load_cost_per_request:
                    self._count("prefix_home")
                    order = sorted(range(len(candidates)), key=lambda k: (k != i, loads[k]))
                    return [[candidates[k]] for k in order]
            self._count("fallback")
            return self._power_of_two(candidates, loads)
        rand = self.rng.random
        # (hot, cost, not the session's, tie-break): the guard first, then the cost, then the
        # session, ties at random.
        keyed = [(t[_HOT], t[_COST], not t[_SESSION], rand(), i) for i, t in enumerate(terms)]
        keyed.sort()
        if self.config.holder_margin_per_block > 0:
            keyed = self._keep_holder(terms, keyed)
        unguarded_best = min(keyed, key=lambda k: k[1:4])
        best = terms[keyed[0][4]]
        if unguarded_best is not keyed[0]:
            self._count("guarded")
        elif best[_REPLICATE]:
            self._count("replicate")
        elif best[_SESSION]:
            turn = self.sessions.get(session)
            remembered = turn is not None and turn.replica_id == best[0]
            self._count("session" if remembered else "session_home")
        else:
            self._count("prefix")
        return [[terms[k[4]][0]] for k in keyed]

    def _evict_oldest(self, candidates: Sequence[str], loads: Sequence[float]) -> Ranks:
        """A prompt nobody holds, among the candidates whose load cost is within one request's
        of the least: to the one whose cache would evict the oldest blocks (the first not yet
        full, the fewest blocks written first; then the earliest ``eviction_horizon``), so the
        replicas' caches together forget what one cache of their total size would. The order
        comes from the replicas' reports alone, so every router of a deployment agrees on it, as
        on a ``prefix_home``. Ties go to the less loaded, then to the least replica id (not the
        candidates' order, which may differ between routers); the rest follow by load. Draws no
        random number."""
        cfg = self.config
        slack = min(loads) + cfg.load_cost_per_request
        eligible = [
            (self.state.view(r).eviction_key(), loads[k], r, k)
            for k, r in enumerate(candidates)
            if loads[k] <= slack
        ]
        i = min(eligible)[3]
        self._count("evict_oldest")
        order = sorted(range(len(candidates)), key=lambda k: (k != i, loads[k]))
        return [[candidates[k]] for k in order]

    def _keep_holder(self, terms: list[tuple], keyed: list[tuple]) -> list[tuple]:
        """Move the cheapest not-hot holder of the longest match to the front when the first
        choice beats it by less than ``holder_margin_per_block`` per block of the match the
        first choice would not import from the KV directory (an import recomputes nothing): leaving a
        holder recomputes its prefix elsewhere and costs cache space there for later requests,
        which the per-request cost does not count."""
        longest = max(t[_MATCHED] for t in terms)
        first = terms[keyed[0][4]]
        # None of the holder's match to recompute (the first choice holds or imports it): no
        # margin; otherwise the margin counts every matched block it would not import.
        recomputed = longest - first[_MATCHED] - first[_TRANSFER]
        if recomputed <= 0 or first[_HOT]:
            return keyed
        for pos, k in enumerate(keyed):
            t = terms[k[4]]
            if t[_MATCHED] == longest and not t[_HOT]:
                margin = self.config.holder_margin_per_block * (longest - first[_TRANSFER])
                if t[_COST] - first[_COST] < margin:
                    return [k, *keyed[:pos], *keyed[pos + 1 :]]
                return keyed
        return keyed

    def _cost_terms(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None,
        session: str | None,
        *,
        count: bool,
    ) -> list[tuple[str, int, int, int, int, int, float, bool, int, bool, int]]:
        """``CandidateScore`` fields per candidate, as tuples. With ``count``, the request is
        counted towards its longest match's heat."""
        cfg = self.config
        ttl = cfg.decision_ttl_s
        n = len(block_hashes)
        # run_end[i]: first index >= i whose block the directory cannot supply (prefix semantics:
        # a replica imports the run of published blocks that directly follows its own match).
        run_end: list[int] | None = None
        if directory_hashes is not None and n:
            run_end = [n] * (n + 1)
            for i in range(n - 1, -1, -1):
                run_end[i] = run_end[i + 1] if block_hashes[i] in directory_hashes else i
        views = [self.state.view(r) for r in candidates]
        loads = [v.estimated_load for v in views]
        min_load = min(loads)
        hot_above = max(min_load + cfg.imbalance_abs, min_load * cfg.imbalance_rel)
        prefill, load_w, queued_w = (
            cfg.prefill_cost_per_block,
            cfg.load_cost_per_request,
            cfg.queued_prefill_cost_per_block,
        )
        matches = [v.matched_blocks(block_hashes, now, ttl) for v in views]
        turn = self.sessions.get(session)
        if turn is not None and turn.replica_id in candidates:
            session_replica: str | None = turn.replica_id
        elif session is not None:
            # Unknown here (a new session, or one another router placed): its home, which every
            # router agrees on, wins ties; the session's prompt is not priced as cached there.
            session_replica = session_home(session, candidates)
            turn = None
        else:
            session_replica = None
        replicate_to = self._replication_depth(block_hashes, matches, now, count)
        # Per candidate node, blocks only another node published (None: all priced same-node).
        remote = (
            None
            if run_end is None
            else remote_block_counts(block_hashes, directory_hashes, [v.node_id for v in views])
        )
        replicate_w = min(prefill, cfg.hot_prefix_cost_per_block)
        terms = []
        for view, load, matched in zip(views, loads, matches, strict=True):
            is_session = view.replica_id == session_replica
            if is_session and turn is not None:
                matched = max(matched, min(n, turn.prompt_blocks))
            transfer = 0 if run_end is None else run_end[matched] - matched
            replicate = max(0, replicate_to - matched - transfer)
            uncached = n - matched - transfer - replicate
            # A replica that measured its import and prefill speeds prices a transferred block
            # by them, from its own node's object store or another's; the configured weight
            # stands in until it has.
            cross = 0
            if remote is not None and transfer and view.node_id is not None:
                counts = remote[view.node_id]
                cross = counts[matched + transfer] - counts[matched]
            same_w, cross_w = transfer_weights(
                prefill,
                cfg.transfer_cost_per_block,
                view.transfer_cost_ratio,
                view.cross_node_transfer_cost_ratio,
            )
            # Queued prefill may be this request's own prefix (a burst sharing a new prompt): the
            # matched blocks are not counted against the replica, or bursts would scatter.
            queued = max(0, view.estimated_prefill_blocks - matched)
            cost = (
                prefill * uncached
                + same_w * (transfer - cross)
                + cross_w * cross
                + replicate_w * replicate
                + load_w * load
                + queued_w * queued
            )
            terms.append(
                (
                    view.replica_id,
                    matched,
                    transfer,
                    uncached,
                    load,
                    queued,
                    cost,
                    load > hot_above,
                    replicate,
                    is_session,
                    cross,
                )
            )
        return terms

    def _replication_depth(
        self, block_hashes: Sequence[int], matches: Sequence[int], now: float, count: bool
    ) -> int:
        """How many leading blocks non-holders may price as a hot prefix's (0: none): the longest
        match, when it is hot and held by fewer replicas than its rate wants."""
        cfg = self.config
        depth = max(matches, default=0)
        if cfg.hot_prefix_rate <= 0 or depth < max(1, cfg.min_match_blocks):
            return 0
        key = block_hashes[depth - 1]
        rate = self.heat.touch(key, now) if count else self.heat.rate(key, now)
        wanted = min(cfg.hot_prefix_max_replicas, 1 + int(rate // cfg.hot_prefix_rate))
        holders = sum(1 for m in matches if m >= depth)
        return depth if holders < wanted else 0


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (PrefixAwarePolicy, PowerOfTwoPolicy, RoundRobinPolicy)
}


def make_policy(
    name: str,
    config: RouterConfig | Mapping[str, Any] | None = None,
    *,
    rng: random.Random | None = None,
) -> RoutingPolicy:
    """A policy by name (``prefix_aware``, ``power_of_two``, ``round_robin``). ``config`` may be a
    ``RouterConfig`` or a mapping of its fields (e.g. ``RouterArgs.model_dump()``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; expected one of {', '.join(sorted(POLICIES))}"
        ) from None
    if config is not None and not isinstance(config, RouterConfig):
        config = RouterConfig.from_mapping(config)
    return cls(config, rng=rng)
