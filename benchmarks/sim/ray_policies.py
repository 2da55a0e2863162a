"""Ray Serve 2.60's own LLM routers, ported as simulator policies to compare ours against.

Both classes follow the ``router.policies.RoutingPolicy`` interface (the simulator drives them
exactly as it drives ours) and re-implement the *decision rules* of Ray's routers in our own
code; Ray's request plumbing (actors, probes, backoff) is replaced by the simulator's.

``RayPrefixAffinityPolicy`` ports ``PrefixCacheAffinityRouter``
(``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py``:
``_prefix_match_best_replicas``, ``choose_replicas``, ``on_request_routed``) and its tree
(``.../prefix_aware/prefix_tree.py``: ``PrefixTree.insert``, ``prefix_match``,
``get_smallest_tenants``, ``evict_tenant_by_lru``, ``_run_eviction_loop``). Per request:

1. Load check: if the highest minus the lowest queue length among the candidates exceeds
   ``imbalanced_threshold`` (Ray's default: infinity, so never), fall back to power of two
   choices.
2. Otherwise match the prompt against the router's tree (what *this router* routed where; Ray
   never looks at the replicas' real caches). ``match_rate = matched / prompt length``. Below
   ``match_rate_threshold`` (0.1) the request goes to the tenants (replicas) with the fewest
   characters in the tree, over *all* tenants as Ray's ``get_smallest_tenants`` does; otherwise
   to the tenants owning the deepest matched node.
3. Among the chosen replicas the one with the shortest queue wins (Ray's
   ``_select_from_candidate_replicas``).
4. After routing, the prompt is inserted into the tree for the chosen replica. With
   ``do_eviction`` (off by default in Ray), every ``eviction_interval_s`` each tenant above
   ``eviction_threshold_chars`` loses its least recently used nodes, whole timestamp groups at a
   time, until it is down to ``eviction_target_chars``.

``RayKVAwarePolicy`` ports ``KVAwareRouter`` (``.../kv_aware/kv_aware_router.py``:
``choose_replicas``; ``.../kv_aware/kv_token_tracker.py``: ``KVTokenTracker.select_worker``,
``on_prefill_complete``, ``on_decode_progress``), which hands scoring to NVIDIA Dynamo's
selection service. The cost followed is Dynamo's default worker selector
(``lib/kv-router/src/scheduling/selector/default.rs``: ``worker_logit``,
``softmax_sample_index``, ``minimum_cost_index``; defaults from ``scheduling/config.rs``)::

    raw_prefill_blocks = (active_prefill_tokens + prompt_tokens) / block_size
    adjusted           = max(0, raw_prefill_blocks - overlap_score_credit * overlap_blocks)
    decode_blocks      = active_blocks + request blocks not already active on the worker
    cost               = prefill_load_scale * adjusted + decode_blocks

``overlap_blocks`` is the longest prefix of the request's block hashes the worker's KV cache
holds (Dynamo's radix indexer over the engines' KV events). Temperature 0 (the default) takes
the least cost, ties at random; a positive temperature samples
``p ~ exp(-(cost - min) / ((max - min) * temperature))`` (uniform when all costs are equal).

Approximations, all forced by what the simulator has:

- No text: the simulator has chained block hashes (one block = ``block_tokens`` tokens). Ray's
  character radix tree becomes a tree of blocks: a chained hash names a whole prefix, so a node
  is one block and its path is the prefix. Characters are counted as tokens: ``match_rate =
  matched_blocks * block_tokens / prompt_tokens`` and a tenant's size is its blocks times
  ``block_tokens`` (times ``chars_per_token`` where a character threshold applies, i.e.
  eviction). A character match can end inside a block or run into the prompt's partial last
  block; here it stops at the last shared full block, so Ray's match rate is understated by at
  most one block per request, and a tenant's size leaves out each prompt's partial tail.
- Ray keeps one tree in a detached actor shared by every ingress replica; the simulator has one
  router, so one tree either way. Actor round-trips cost no time.
- Queue lengths: Ray probes replicas and caches the answers; the ports read this router's load
  estimate (``ReplicaView.estimated_load``: the exact queue length observed at each routing plus
  the periodic reports), the same figure the simulator's power of two uses.
- When a chosen replica is full (``max_ongoing_requests``) Ray backs off and asks again, which
  for a prefix match returns the same replicas; the simulator instead moves to the next rank
  (the other candidates by queue length or cost). At the default cap of 256 this does not occur.
- The KV-aware port reads each replica's engine state at routing time through
  ``bind_signals``: the prefix its KV cache holds, the blocks held by running requests and the
  prompt tokens still to prefill. Dynamo gets these from KV events and lifecycle hooks a few
  milliseconds late; the port sees them with no delay, an advantage, not a handicap.
- Dynamo's decode-block decay (weighting a request's blocks by the share of ``max_tokens`` still
  to generate), host/disk tiers and ``overlap_score_credit_decay`` (default 0) are not modelled:
  every active block weighs 1.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from router.policies import Ranks, RoutingPolicy


@dataclass(frozen=True)
class PrefixAffinityConfig:
    """``PrefixCacheAffinityRouter.initialize_state``'s arguments, Ray's defaults."""

    imbalanced_threshold: float = math.inf
    match_rate_threshold: float = 0.1
    do_eviction: bool = False
    eviction_threshold_chars: int = 400_000
    eviction_target_chars: int = 360_000
    eviction_interval_s: float = 10.0
    chars_per_token: float = 4.0  # converts the character thresholds to simulated tokens
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.match_rate_threshold <= 1.0:
            raise ValueError("match_rate_threshold: must be in [0, 1]")
        if self.block_tokens < 1 or self.chars_per_token <= 0 or self.eviction_interval_s <= 0:
            raise ValueError("block_tokens, chars_per_token and eviction_interval_s must be > 0")


@dataclass(frozen=True)
class KVAwareConfig:
    """Dynamo's ``KvRouterConfig`` fields the default selector reads, Dynamo's defaults."""

    prefill_load_scale: float = 1.0
    overlap_score_credit: float = 1.0
    router_temperature: float = 0.0
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if self.prefill_load_scale < 0 or self.overlap_score_credit < 0:
            raise ValueError("prefill_load_scale and overlap_score_credit must be >= 0")
        if self.router_temperature < 0 or self.block_tokens < 1:
            raise ValueError("router_temperature must be >= 0 and block_tokens >= 1")


@dataclass(frozen=True, slots=True)
class KVSignals:
    """What Dynamo's selection service knows about one worker for one request.

    ``overlap_blocks``: leading request blocks in the worker's KV cache; ``active_blocks``: blocks
    held by requests on the worker; ``shared_active_blocks``: leading request blocks among those;
    ``active_prefill_tokens``: prompt tokens queued for prefill there."""

    overlap_blocks: int
    active_blocks: int
    shared_active_blocks: int
    active_prefill_tokens: int


SignalSource = Callable[[str, Sequence[int]], KVSignals]


class PrefixBlockTree:
    """Ray's ``PrefixTree`` over chained block hashes: ``owners[h]`` maps each tenant holding the
    block (prefix) ``h`` to its last access time; ``size[t]`` is tenant ``t``'s token count.

    Invariant: a tenant holding a block holds its whole prefix, with access times that never
    decrease towards the root (every insert touches the whole path with one time)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.owners: dict[int, dict[str, float]] = {}
        self.size: dict[str, int] = {}

    def add_tenants(self, tenants: Iterable[str]) -> None:
        for tenant in tenants:
            self.size.setdefault(tenant, 0)

    def remove_tenant(self, tenant: str) -> None:
        self.size.pop(tenant, None)
        for h in [h for h, owners in self.owners.items() if tenant in owners]:
            self._drop(h, tenant)

    def insert(self, block_hashes: Sequence[int], tenant: str, now: float) -> None:
        if tenant not in self.size:
            return  # as Ray: unknown tenants are not inserted
        for h in block_hashes:
            owners = self.owners.setdefault(h, {})
            if tenant not in owners:
                self.size[tenant] += self.block_tokens
            owners[tenant] = now

    def match(self, block_hashes: Sequence[int], tenants: Sequence[str]) -> tuple[int, list[str]]:
        """(matched blocks, tenants among ``tenants`` owning the deepest matched block). With no
        match, every known tenant of ``tenants`` (Ray returns all available tenants)."""
        known = [t for t in tenants if t in self.size]
        deepest: dict[str, float] | None = None
        matched = 0
        for h in block_hashes:
            owners = self.owners.get(h)
            if owners is None or not any(t in owners for t in known):
                break
            deepest = owners
            matched += 1
        if deepest is None:
            return 0, known
        return matched, [t for t in known if t in deepest]

    def smallest_tenants(self) -> list[str]:
        if not self.size:
            return []
        least = min(self.size.values())
        return [t for t, n in self.size.items() if n == least]

    def evict_lru(self, tenant: str, min_remove_tokens: int) -> int:
        """Drop the tenant's least recently used blocks, a whole group of equal access time at a
        time, until at least ``min_remove_tokens`` are gone; returns the tokens removed."""
        if tenant not in self.size:
            return 0
        target = min(min_remove_tokens, self.size[tenant])
        held = sorted((owners[tenant], h) for h, owners in self.owners.items() if tenant in owners)
        removed = i = 0
        while removed < target and i < len(held):
            stamp = held[i][0]
            while i < len(held) and held[i][0] == stamp:
                self._drop(held[i][1], tenant)
                removed += self.block_tokens
                i += 1
        return removed

    def _drop(self, h: int, tenant: str) -> None:
        owners = self.owners[h]
        del owners[tenant]
        if tenant in self.size:
            self.size[tenant] -= self.block_tokens
        if not owners:
            del self.owners[h]


class _SimPort(RoutingPolicy):
    """A policy that also wants the prompt's length in tokens (``rank_prompt``)."""

    block_tokens: int

    def rank(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        now: float,
        directory_hashes: Container[int] | None = None,
        *,
        session: str | None = None,
    ) -> Ranks:
        return self.rank_prompt(
            candidates, block_hashes, len(block_hashes) * self.block_tokens, now
        )

    def rank_prompt(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        now: float,
        directory_hashes: Container[int] | None = None,
    ) -> Ranks:
        raise NotImplementedError

    def _by_queue(self, replica_ids: Iterable[str]) -> list[str]:
        """Shortest queue first (ties at random), as Ray's replica selection picks."""
        keyed = [(self.state.view(r).estimated_load, self.rng.random(), r) for r in replica_ids]
        return [r for _, _, r in sorted(keyed)]


class RayPrefixAffinityPolicy(_SimPort):
    """Ray's ``PrefixCacheAffinityRouter`` (see the module docstring). ``counters``: ``imbalanced``
    (power of two), ``smallest_tenant`` (match rate below the threshold), ``prefix``."""

    name: ClassVar[str] = "ray_prefix_affinity"

    def __init__(
        self, config: PrefixAffinityConfig | None = None, *, rng: random.Random | None = None
    ) -> None:
        super().__init__(None, rng=rng)
        self.ray_config = config if config is not None else PrefixAffinityConfig()
        self.block_tokens = self.ray_config.block_tokens
        self.tree = PrefixBlockTree(self.block_tokens)
        self._next_eviction: float | None = None

    def update_replicas(self, replica_ids: Iterable[str]) -> None:
        ids = list(replica_ids)
        super().update_replicas(ids)
        for tenant in [t for t in self.tree.size if t not in ids]:
            self.tree.remove_tenant(tenant)
        self.tree.add_tenants(ids)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.tree.remove_tenant(replica_id)

    def rank_prompt(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        now: float,
        directory_hashes: Container[int] | None = None,
    ) -> Ranks:
        if not candidates:
            return []
        self._maybe_evict(now)
        cfg = self.ray_config
        loads = [self.state.view(r).estimated_load for r in candidates]
        if max(loads) - min(loads) > cfg.imbalanced_threshold:
            self._count("imbalanced")
            return self._power_of_two(candidates)
        matched, owners = self.tree.match(block_hashes, candidates)
        rate = matched * self.block_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
        if rate < cfg.match_rate_threshold:
            self._count("smallest_tenant")
            chosen = self.tree.smallest_tenants()
        else:
            self._count("prefix")
            chosen = owners
        # Ray's smallest tenants may include replicas that are not candidates; it would route to
        # them anyway. The simulator only offers candidates, so keep those.
        allowed = set(candidates)
        first = self._by_queue(r for r in chosen if r in allowed)
        if not first:
            return self._power_of_two(candidates)
        taken = set(first)
        return [[r] for r in first] + [[r] for r in self._by_queue(candidates) if r not in taken]

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
        self.tree.insert(block_hashes, replica_id, now)

    def _maybe_evict(self, now: float) -> None:
        cfg = self.ray_config
        if not cfg.do_eviction:
            return
        if self._next_eviction is None:
            self._next_eviction = now + cfg.eviction_interval_s
        while now >= self._next_eviction:
            self._next_eviction += cfg.eviction_interval_s
            per_token = cfg.chars_per_token
            for tenant, tokens in list(self.tree.size.items()):
                chars = tokens * per_token
                if chars > cfg.eviction_threshold_chars:
                    excess = (chars - cfg.eviction_target_chars) / per_token
                    self.tree.evict_lru(tenant, math.ceil(excess))


def softmax_pick(costs: Sequence[float], temperature: float, sample: float) -> int:
    """Dynamo's softmax over negated costs normalised by their range: the index whose cumulative
    probability first reaches ``sample`` (in [0, 1)); uniform when all costs are equal."""
    low, high = min(costs), max(costs)
    if low == high:
        weights = [1.0] * len(costs)
    else:
        scale = 1.0 / ((high - low) * temperature)
        weights = [math.exp(-(c - low) * scale) for c in costs]
    total = sum(weights)
    cumulative = 0.0
    for i, w in enumerate(weights):
        cumulative += w / total
        if sample <= cumulative:
            return i
    return len(costs) - 1


class RayKVAwarePolicy(_SimPort):
    """Ray's ``KVAwareRouter`` with Dynamo's default cost (see the module docstring). Needs
    ``bind_signals`` before the first ``rank``."""

    name: ClassVar[str] = "ray_kv_aware"

    def __init__(
        self, config: KVAwareConfig | None = None, *, rng: random.Random | None = None
    ) -> None:
        super().__init__(None, rng=rng)
        self.ray_config = config if config is not None else KVAwareConfig()
        self.block_tokens = self.ray_config.block_tokens
        self._signals: SignalSource | None = None

    def bind_signals(self, source: SignalSource) -> None:
        self._signals = source

    def costs(
        self, candidates: Sequence[str], block_hashes: Sequence[int], prompt_tokens: int
    ) -> list[float]:
        """Dynamo's cost of each candidate, in candidate order."""
        if self._signals is None:
            raise RuntimeError("RayKVAwarePolicy needs bind_signals() before ranking")
        cfg = self.ray_config
        bs = self.block_tokens
        request_blocks = -(-prompt_tokens // bs)
        out = []
        for replica_id in candidates:
            s = self._signals(replica_id, block_hashes)
            raw_prefill = (s.active_prefill_tokens + prompt_tokens) / bs
            adjusted = max(0.0, raw_prefill - cfg.overlap_score_credit * s.overlap_blocks)
            decode = s.active_blocks + max(0, request_blocks - s.shared_active_blocks)
            out.append(cfg.prefill_load_scale * adjusted + decode)
        return out

    def rank_prompt(
        self,
        candidates: Sequence[str],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        now: float,
        directory_hashes: Container[int] | None = None,
    ) -> Ranks:
        if not candidates:
            return []
        costs = self.costs(candidates, block_hashes, prompt_tokens)
        temperature = self.ray_config.router_temperature
        if temperature > 0:
            self._count("softmax")
            best = softmax_pick(costs, temperature, self.rng.random())
        else:
            self._count("argmin")
            low = min(costs)
            best = self.rng.choice([i for i, c in enumerate(costs) if c == low])
        rest = sorted(
            (i for i in range(len(candidates)) if i != best),
            key=lambda i: (costs[i], self.rng.random()),
        )
        return [[candidates[i]] for i in (best, *rest)]


PORTS: dict[str, type[_SimPort]] = {
    RayPrefixAffinityPolicy.name: RayPrefixAffinityPolicy,
    RayKVAwarePolicy.name: RayKVAwarePolicy,
}
_PORT_CONFIGS: dict[str, type[Any]] = {
    RayPrefixAffinityPolicy.name: PrefixAffinityConfig,
    RayKVAwarePolicy.name: KVAwareConfig,
}


def make_port(
    name: str, options: dict[str, Any], block_tokens: int, rng: random.Random
) -> RoutingPolicy:
    """A ported Ray policy by name; ``options`` are fields of its config dataclass (the block size
    is the simulator's)."""
    config_cls = _PORT_CONFIGS[name]
    known = {f.name for f in dataclasses.fields(config_cls)} - {"block_tokens"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; expected some of {sorted(known)}")
    config = config_cls(**{**options, "block_tokens": block_tokens})
    return PORTS[name](config, rng=rng)
