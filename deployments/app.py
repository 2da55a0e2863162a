"""The application builder named by ``serve_config.yaml`` (``deployments.app:build_app``).

Serve-level options are derived from ``AppArgs.limits`` so that every queue is bounded and every
overflow is a 429 with ``Retry-After`` (Serve's own backpressure answers 503 unless told
otherwise). A ``deployments`` entry in ``serve_config.yaml`` still overrides any of them.
"""

from __future__ import annotations

import secrets
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, DeploymentActorConfig

from deployments.config import AppArgs
from deployments.engine_replica import KV_DIRECTORY_ACTOR, EngineReplica
from deployments.engine_server import EngineServer
from deployments.engine_server import app as engine_server_app
from deployments.ingress import Ingress
from deployments.kv_directory import KVDirectory
from deployments.registry import ReplicaRegistry
from deployments.replica_report import REGISTRY_ACTOR
from deployments.request_router_config import request_router_config
from deployments.route_app import ReplicaChooser
from engine.model.loader import check_model

# Serve's max_ongoing_requests counts control calls (metrics, health, KV directory stats) too:
# leave them room above the admission limits, which the replicas enforce themselves.
CONTROL_HEADROOM = 8
# Kept small on purpose: beyond it Serve's proxy itself queues (max_queued_at_proxy) and refuses
# the overflow, which costs far less CPU than a trip to the ingress. The few extra slots serve
# /health, /metrics and requests that the ingress refuses with an OpenAI-style 429.
INGRESS_HEADROOM = 4
# An engine loop that died fails check_health at once; Serve replaces a replica after three
# failed checks in a row, so this period bounds detection at about 3 x 2 s. The timeout is long
# because a replica busy on 2 cores can be slow to answer without being broken.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0


def _backpressure(args: AppArgs) -> BackpressureConfig:
    return BackpressureConfig(status_code=429, retry_after_s=args.limits.retry_after_s)


def engine_serve_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of the Engine deployment that follow from the limits."""
    options: dict[str, Any] = {
        "max_queued_requests": (
            args.limits.max_queued_for_engine or args.limits.max_ongoing_per_ingress
        ),
        "backpressure_config": _backpressure(args),
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
    }
    if args.limits.max_waiting_per_replica is not None:
        capacity = args.engine.max_num_seqs + args.limits.max_waiting_per_replica
        options["max_ongoing_requests"] = capacity + CONTROL_HEADROOM
    return options


def ingress_serve_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of the Ingress deployment that follow from the limits."""
    return {
        "max_ongoing_requests": args.limits.max_ongoing_per_ingress + INGRESS_HEADROOM,
        "max_queued_requests": args.limits.max_queued_at_proxy,
        "backpressure_config": _backpressure(args),
    }


def _deployment_actors(args: AppArgs) -> list[DeploymentActorConfig]:
    actors = [
        DeploymentActorConfig(
            name=REGISTRY_ACTOR, actor_class=ReplicaRegistry, actor_options={"num_cpus": 0}
        )
    ]
    if args.kv_sharing.enabled:
        actors.append(
            DeploymentActorConfig(
                name=KV_DIRECTORY_ACTOR,
                actor_class=KVDirectory,
                init_kwargs={
                    "capacity_bytes": args.kv_sharing.capacity_bytes,
                    "eviction": args.kv_sharing.eviction,
                },
                actor_options={"num_cpus": 0},
            )
        )
    return actors


def _engine_router_config(args: AppArgs) -> Any:
    return request_router_config(
        args.routing_policy,
        args.router.model_dump(),
        args.router.stats_period_s,
        kv_sharing=args.kv_sharing.enabled,
        ray_args=args.ray_prefix_affinity.model_dump(),
    )


def engine_deployment(args: AppArgs) -> Any:
    options: dict[str, Any] = {
        **engine_serve_options(args),
        "name": "Engine",
        "deployment_actors": _deployment_actors(args),
        "request_router_config": _engine_router_config(args),
    }
    return serve.deployment(EngineReplica).options(**options)


def prefill_deployment(args: AppArgs) -> Any:
    """Prefill/decode disaggregation's prefill side: the same replica class and engine, routed
    by the same policy (cache hits and queued prefill), without deployment actors of its own:
    its replicas use the Engine deployment's KV directory and registry."""
    return serve.deployment(EngineReplica).options(
        **engine_serve_options(args),
        name="Prefill",
        num_replicas=args.disaggregation.prefill_replicas,
        request_router_config=_engine_router_config(args),
    )


def engine_server_deployment(args: AppArgs) -> Any:
    """The direct layout's only deployment: engine replicas that serve HTTP themselves."""
    options = engine_serve_options(args)
    # Control calls and the HTTP side's own admission (it answers 429 past its limit).
    options["max_ongoing_requests"] = args.limits.max_ongoing_per_ingress + INGRESS_HEADROOM
    # Under direct ingress Serve counts a request as queued from its arrival until it holds one
    # of those slots, a wait of one event-loop turn even when slots are free: a burst of more
    # arrivals than this limit in one turn would be refused with free slots. So the queue limit
    # covers every slot plus the real queue.
    options["max_queued_requests"] = (
        options["max_ongoing_requests"] + args.limits.max_queued_at_proxy
    )
    return serve.deployment(serve.ingress(engine_server_app)(EngineServer)).options(
        name="Engine", deployment_actors=_deployment_actors(args), **options
    )


def _num_replicas(options: dict[str, Any] | None) -> int | None:
    """The replica count the options fix, if any (an autoscaled deployment has none)."""
    options = options or {}
    if "autoscaling_config" in options:
        return None
    return options.get("num_replicas")


def build_app(args: dict[str, Any]) -> Application:
    """Validate ``args`` (unknown keys are errors) and bind the layout's deployments."""
    return build(AppArgs.model_validate(args or {}))


def build(
    args: AppArgs,
    engine_options: dict[str, Any] | None = None,
    ingress_options: dict[str, Any] | None = None,
) -> Application:
    """The application graph; the options override deployment settings (replicas, CPUs) for
    programmatic use, where ``serve_config.yaml``'s ``deployments`` section is absent."""
    # A bad model is one error here, where `serve run` / `serve deploy` reports it, instead of
    # the same error in every replica, restarted by Serve until it gives up.
    check_model(args.model, args.tokenizer)
    if args.kv_hash_key is None:
        # One secret per build, shared by every deployment of the application.
        args = args.model_copy(update={"kv_hash_key": secrets.token_hex(16)})
    plain = args.model_dump()
    if args.layout == "direct":
        server = engine_server_deployment(args)
        if engine_options:
            server = server.options(**engine_options)
        if _num_replicas(engine_options) == 1 or args.routing_policy == "least_connections":
            # HAProxy alone balances, by least connections.
            return server.bind(plain)
        server = server.options(
            request_router_config=request_router_config(
                args.routing_policy,
                args.router.model_dump(),
                args.router.stats_period_s,
                kv_sharing=args.kv_sharing.enabled,
            )
        )
        app = server.bind(plain)
        return app._with_ingress_request_router(ReplicaChooser.bind(app, plain))
    engine = engine_deployment(args)
    if engine_options:
        engine = engine.options(**engine_options)
    ingress = Ingress.options(**ingress_serve_options(args))
    if ingress_options:
        ingress = ingress.options(**ingress_options)
    engine_app = engine.bind(plain)
    if not args.disaggregation.enabled:
        return ingress.bind(engine_app, plain)
    prefill = prefill_deployment(args)
    # The engine options' placement (CPUs per replica...) applies to both sides; the count is
    # the disaggregation section's.
    shared = {
        k: v
        for k, v in (engine_options or {}).items()
        if k not in ("num_replicas", "autoscaling_config")
    }
    if shared:
        prefill = prefill.options(**shared)
    return ingress.bind(engine_app, plain, prefill.bind(plain, engine_app))
