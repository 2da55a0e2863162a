"""The Engine deployment's ``RequestRouterConfig``: which request router a routing policy name
stands for, and the validated arguments it is started with.

Invariants: every name ``request_router_config`` accepts maps to exactly one router class (ours
in ``deployments.request_router``, or Ray's ``PrefixCacheAffinityRouter``); an unknown name or
an invalid argument raises ``ValueError`` here, when the application is built, never later in
the ingress process where Serve starts the router. Nothing here runs inside a router: Serve
pickles only the router class's own module by value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve.config import RequestRouterConfig

from deployments.request_router import (
    PolicyRequestRouter,
    PowerOfTwoRequestRouter,
    PrefixAwareRequestRouter,
    RoundRobinRequestRouter,
)
from router import RouterConfig

REQUEST_ROUTERS: dict[str, type[PolicyRequestRouter]] = {
    cls.policy_name: cls
    for cls in (PrefixAwareRequestRouter, PowerOfTwoRequestRouter, RoundRobinRequestRouter)
}


# Ray Serve's own prefix router, plugged in as is for comparison: it matches the prompt's text
# (a request argument's ``prompt`` attribute, which ``EngineRequest`` carries under this policy)
# against a tree of what it sent where.
RAY_PREFIX_AFFINITY = "ray_prefix_affinity"


def ray_prefix_affinity_config(
    ray_args: Mapping[str, Any] | None = None, stats_period_s: float = 1.0
) -> RequestRouterConfig:
    """``RequestRouterConfig`` for Ray's ``PrefixCacheAffinityRouter``; ``ray_args`` holds
    ``deployments.config.RayPrefixAffinityArgs`` fields (validated here; unset ones keep Ray's
    defaults) and reaches the router's ``initialize_state`` as its kwargs."""
    # Imported here so that only this policy loads it. Ray's public re-export of the class
    # (ray.serve.llm) needs the ray[llm] extra's dependencies; the class itself does not.
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    from deployments.config import RayPrefixAffinityArgs

    kwargs = RayPrefixAffinityArgs.model_validate(dict(ray_args or {})).model_dump(
        exclude_none=True
    )
    return RequestRouterConfig(
        request_router_class=PrefixCacheAffinityRouter,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
    )


def request_router_config(
    policy: str,
    router_args: Mapping[str, Any],
    stats_period_s: float = 1.0,
    kv_sharing: bool = False,
    ray_args: Mapping[str, Any] | None = None,
) -> RequestRouterConfig:
    """The Engine deployment's ``RequestRouterConfig`` for ``policy`` (``prefix_aware``,
    ``power_of_two``, ``round_robin``, or ``ray_prefix_affinity``: Ray's own, configured by
    ``ray_args``). ``router_args`` holds ``router.RouterConfig`` fields
    (e.g. ``AppArgs.router.model_dump()``; its ``stats_period_s`` is ignored in favour of the
    argument); they are validated here and reach the router as ``request_router_kwargs``.
    ``stats_period_s`` is how often Serve polls each replica's ``record_routing_stats()``. With
    ``kv_sharing``, blocks cached on any replica count as importable at transfer cost."""
    if policy == RAY_PREFIX_AFFINITY:
        return ray_prefix_affinity_config(ray_args, stats_period_s)
    try:
        cls = REQUEST_ROUTERS[policy]
    except KeyError:
        known = sorted([*REQUEST_ROUTERS, RAY_PREFIX_AFFINITY])
        raise ValueError(
            f"unknown routing policy {policy!r}; expected one of {', '.join(known)}"
        ) from None
    config = RouterConfig.from_mapping(router_args)
    return RequestRouterConfig(
        request_router_class=cls,
        request_router_kwargs={**config.to_dict(), "kv_sharing": kv_sharing},
        request_routing_stats_period_s=stats_period_s,
    )
