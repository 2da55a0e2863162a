"""Weights and thresholds of the routing cost model: one frozen dataclass, validated once.

Costs are in *block-prefill units*: 1.0 is the time a replica needs to prefill one KV block of
``block_size`` tokens. Every weight below is expressed in that unit, so only their ratios matter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Keys of the application's ``router`` args that configure the Serve adapter, not the policy.
ADAPTER_KEYS = frozenset({"stats_period_s"})


@dataclass(frozen=True)
class RouterConfig:
    """Weights and thresholds of the prefix-aware cost; the other policies read only what they need.

    The cost of sending a request to replica ``r`` is::

        prefill_cost_per_block  * (blocks neither cached on r nor fetchable from the KV directory)
      + transfer_cost_per_block * (blocks not cached on r but published to the KV directory)
      + load_cost_per_request   * (estimated requests running or waiting on r)
      + queued_prefill_cost_per_block * (prompt blocks awaiting prefill on r, less the matched ones)
    """

    # Cost of computing one uncached prompt block on the chosen replica (block-prefill units).
    # Raising it makes cache hits worth more relative to load: stickier routing.
    prefill_cost_per_block: float = 1.0
    # Cost of each request already running or waiting on a replica (block-prefill units per
    # request), beyond its queued prefill (counted below): each running sequence lengthens
    # every step of the replica a little. Raising it spreads load sooner, at the cost of hits.
    load_cost_per_request: float = 0.25
    # Cost of importing one block that another replica published to the shared KV directory
    # instead of recomputing it (block-prefill units). Only used when the caller says which hashes
    # the directory holds. Below prefill_cost_per_block, a directory hit counts as a cheap miss.
    # A replica that reports its measured ``transfer_cost_ratio`` (seconds to import a block over
    # seconds to prefill one) is priced at prefill_cost_per_block * that ratio instead.
    transfer_cost_per_block: float = 0.25
    # Cost of each prompt block already queued for prefill on a replica (block-prefill units per
    # block). Requests count alike whatever their prompt; this term tells a replica that is busy
    # prefilling a long cold prompt (a new request waits behind it) from one that only decodes.
    # Below prefill_cost_per_block although a block queued ahead delays the first token as much
    # as one of the request's own: leaving a busy holder recomputes the prefix, which costs the
    # cluster throughput for every later request too (the queue counts less the request's
    # matched blocks, since the queued work may be the very prefix it would reuse).
    queued_prefill_cost_per_block: float = 0.25
    # Hysteresis for leaving a holder: the candidate(s) holding the longest match stay first
    # unless another (not hot) candidate's cost is lower by more than this many block-prefill
    # units per matched block. 0: the plain cost ranking.
    holder_margin_per_block: float = 1.0
    # Fewest leading blocks some replica must hold for the request before the prefix cost is used.
    min_match_blocks: int = 1
    # With a shorter best match, first try the replica every router of the deployment picks for
    # the prompt's first block (``router.affinity.prefix_home``) unless its load cost exceeds the
    # least by more than one request's: routers that share no memory (one per proxy node) then
    # meet on one replica with a new system prompt. False: the better of two random replicas.
    prefix_home: bool = True
    # With a shorter best match (and no session), send the prompt, among the candidates whose
    # load cost is within one request's of the least, to the replica whose cache would evict the
    # oldest blocks for it (``ReplicaView.eviction_key``: the fewest blocks written while caches
    # fill, then the longest since its latest capacity's worth of writes), so the caches together
    # evict about what one LRU cache of their total size would; ties go to the prefix home.
    # Takes precedence over ``prefix_home``. False: ``prefix_home``, then power of two choices.
    evict_oldest: bool = True
    # Imbalance guard: a replica is "hot" when its load exceeds the least-loaded candidate's by more
    # than imbalance_abs requests AND is more than imbalance_rel times it. Hot replicas are ranked
    # after every other one, whatever their cache holds.
    imbalance_abs: int = 8
    imbalance_rel: float = 2.0
    # How long (seconds) this router's own routing decisions count as cached blocks on the chosen
    # replica after the request completes, when no newer report confirms or refutes them. While the
    # request is in flight its blocks stay pinned on the replica, so they count regardless.
    decision_ttl_s: float = 30.0
    # Session affinity: how many sessions (x-session-id header or the OpenAI ``user`` field) the
    # router remembers, least recently routed forgotten first. A session's latest replica is
    # priced as holding the session's previous prompt, and wins ties. 0 turns it off.
    session_capacity: int = 65536
    # Hot-prefix replication. A prefix (the longest match any candidate holds) asked for more than
    # hot_prefix_rate times per second (a decaying count over hot_prefix_window_s) wants one more
    # holder per hot_prefix_rate of rate, up to hot_prefix_max_replicas. While it has fewer,
    # replicas that lack it pay hot_prefix_cost_per_block (not prefill_cost_per_block) for its
    # blocks: its prefill is paid once and then shared by every later request, so a loaded
    # holder hands some of its requests to a second replica, which then holds the prefix too.
    # hot_prefix_rate 0 turns replication off.
    hot_prefix_rate: float = 1.0
    hot_prefix_window_s: float = 10.0
    hot_prefix_cost_per_block: float = 0.25
    hot_prefix_max_replicas: int = 2
    # How many prefixes' rates are tracked (least recently asked for forgotten first).
    hot_prefix_capacity: int = 16384

    def __post_init__(self) -> None:
        for name in (
            "prefill_cost_per_block",
            "load_cost_per_request",
            "transfer_cost_per_block",
            "queued_prefill_cost_per_block",
            "holder_margin_per_block",
            "hot_prefix_rate",
            "hot_prefix_cost_per_block",
        ):
            _check_float(name, getattr(self, name), minimum=0.0)
        _check_float("hot_prefix_window_s", self.hot_prefix_window_s, minimum=0.0, exclusive=True)
        for name in (
            "min_match_blocks",
            "imbalance_abs",
            "session_capacity",
            "hot_prefix_max_replicas",
            "hot_prefix_capacity",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        if not isinstance(self.evict_oldest, bool):
            raise ValueError(f"evict_oldest: must be a boolean, got {self.evict_oldest!r}")
        if not isinstance(self.prefix_home, bool):
            raise ValueError(f"prefix_home: must be a boolean, got {self.prefix_home!r}")
        _check_float("imbalance_rel", self.imbalance_rel, minimum=1.0)
        _check_float("decision_ttl_s", self.decision_ttl_s, minimum=0.0, exclusive=True)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> RouterConfig:
        """Build from a mapping such as ``RouterArgs.model_dump()``.

        Keys that configure the Serve adapter (``ADAPTER_KEYS``) are ignored; any other unknown key
        is an error naming it, since a misspelt weight would otherwise fall back to its default.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known - ADAPTER_KEYS)
        if unknown:
            raise ValueError(f"unknown router option(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in options.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_float(name: str, value: object, *, minimum: float, exclusive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < minimum or (exclusive and value == minimum):
        bound = ">" if exclusive else ">="
        raise ValueError(f"{name}: must be {bound} {minimum}, got {value!r}")
