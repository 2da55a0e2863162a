"""Prefix-hash-aware routing: pick the engine replica whose KV cache already holds a request's
prefix, unless it is so busy that waiting costs more than recomputing elsewhere.

Pure Python with no Ray dependency, so that a simulator can drive the same code as the Ray Serve
adapter (``deployments/request_router.py``). See ``docs/routing.md`` for the cost model.
"""

from router.config import RouterConfig
from router.policies import (
    POLICIES,
    CandidateScore,
    PowerOfTwoPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from router.report import ReplicaReport
from router.state import ClusterState, ReplicaView
from router.topology import BlockLocations, PublishedBlocks

__all__ = [
    "POLICIES",
    "BlockLocations",
    "CandidateScore",
    "ClusterState",
    "PowerOfTwoPolicy",
    "PrefixAwarePolicy",
    "PublishedBlocks",
    "ReplicaReport",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouterConfig",
    "RoutingPolicy",
    "make_policy",
]
