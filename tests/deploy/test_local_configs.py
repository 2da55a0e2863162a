"""The alternative laptop config (``deploy/local/two_replicas.yaml``) is a valid Serve config and
differs from the shipped ``serve_config.yaml`` only where the two layouts it is measured against
differ: replicas, their CPUs and the routing policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deployments.config import AppArgs
from tests.deploy.serve_checks import differing_keys, flatten, serve_config_errors

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "serve_config.yaml"
TWO_REPLICAS = ROOT / "deploy" / "local" / "two_replicas.yaml"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def test_two_replica_config_is_valid() -> None:
    config = load(TWO_REPLICAS)
    assert serve_config_errors(config) == []
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.layout == "direct" and args.routing_policy == "prefix_aware"


def test_two_replica_config_differs_only_in_replicas_and_routing() -> None:
    shipped, two = load(SHIPPED), load(TWO_REPLICAS)
    assert (
        differing_keys(
            {k: v for k, v in shipped.items() if k != "applications"},
            {k: v for k, v in two.items() if k != "applications"},
        )
        == set()
    )
    app, two_app = shipped["applications"][0], two["applications"][0]
    args = flatten(AppArgs.model_validate(app["args"]).model_dump())
    two_args = flatten(AppArgs.model_validate(two_app["args"]).model_dump())
    assert {k for k in args if args[k] != two_args.get(k)} == {"routing_policy"}
    assert app["deployments"] != two_app["deployments"]
    (engine,), (two_engine,) = app["deployments"], two_app["deployments"]
    assert engine["num_replicas"] * engine["ray_actor_options"]["num_cpus"] == 2
    assert (two_engine["num_replicas"], two_engine["ray_actor_options"]["num_cpus"]) == (2, 1)
