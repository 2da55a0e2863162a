"""The application builder named by ``serve_config.yaml`` (``deployments.app:build_app``)."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import DeploymentActorConfig

from deployments.config import AppArgs
from deployments.engine_replica import KV_DIRECTORY_ACTOR, REGISTRY_ACTOR, EngineReplica
from deployments.ingress import Ingress
from deployments.kv_directory import KVDirectory
from deployments.registry import ReplicaRegistry
from deployments.request_router import request_router_config


def engine_deployment(args: AppArgs) -> Any:
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
    options: dict[str, Any] = {
        "name": "Engine",
        "deployment_actors": actors,
        "request_router_config": request_router_config(
            args.routing_policy,
            args.router.model_dump(),
            args.router.stats_period_s,
            kv_sharing=args.kv_sharing.enabled,
        ),
    }
    return serve.deployment(EngineReplica).options(**options)


def build_app(args: dict[str, Any]) -> Application:
    """Validate ``args`` (unknown keys are errors) and bind Ingress -> Engine."""
    return build(AppArgs.model_validate(args or {}))


def build(
    args: AppArgs,
    engine_options: dict[str, Any] | None = None,
    ingress_options: dict[str, Any] | None = None,
) -> Application:
    """The application graph; the options override deployment settings (replicas, CPUs) for
    programmatic use, where ``serve_config.yaml``'s ``deployments`` section is absent."""
    plain = args.model_dump()
    engine = engine_deployment(args)
    if engine_options:
        engine = engine.options(**engine_options)
    ingress = Ingress.options(**ingress_options) if ingress_options else Ingress
    return ingress.bind(engine.bind(plain), plain)
