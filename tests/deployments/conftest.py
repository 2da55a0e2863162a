"""One Ray cluster and one Serve instance for every integration test in the session."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deployments.ray_env import LAPTOP_RAY_ENV, SERVE_PROCESS_ENV

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The cluster's controller and proxy run with the settings the app ships with, and those of a
# cluster started on the machine it serves from (`make test` exports both, as `make serve` does).
for _key, _value in {**SERVE_PROCESS_ENV, **LAPTOP_RAY_ENV}.items():
    os.environ.setdefault(_key, _value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# HAProxy's own listeners (Prometheus exporter, stats page) have fixed default ports; free ones
# let the tests run beside a `make serve` on the same machine.
os.environ.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", str(_free_port()))
os.environ.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", str(_free_port()))


# A custom resource only the head node has. Serve runs one direct-layout replica chooser per
# node that holds a replica, and HAProxy spreads requests over every chooser on its host; the two
# nodes here share one host, so it alternates between two routers that share no memory, which a
# real cluster (one chooser per HAProxy) never does. A test of one router's choices keeps its
# engine replicas on the head node with ON_HEAD_NODE.
HEAD_RESOURCE = "test_head_node"
ON_HEAD_NODE = {"resources": {HEAD_RESOURCE: 1}}


@pytest.fixture(scope="session")
def serve_instance() -> Iterator[str]:
    """A two-node Ray cluster on this machine (so objects can cross object stores) with Serve's
    HTTP proxy on the head node at a free port; yields the base URL."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    port = _free_port()
    # Logical CPUs: replicas take fractions; the 2 physical cores are shared by everything.
    node_args = {"num_cpus": 4, "object_store_memory": 192 * 1024 * 1024}
    cluster = Cluster(
        initialize_head=True,
        # HEAD_RESOURCE lets a test keep its replicas on the head node (ON_HEAD_NODE).
        head_node_args={
            **node_args,
            "include_dashboard": False,
            "resources": {HEAD_RESOURCE: 1000},
        },
    )
    cluster.add_node(**node_args)
    ray.init(
        address=cluster.address,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}},
    )
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def deploy(
    base_url: str,
    args: dict[str, Any],
    *,
    num_replicas: int = 2,
    name: str = "prefixserve",
    engine_num_cpus: float = 0.5,
    engine_options: dict[str, Any] | None = None,
    timeout_s: float = 180.0,
    layout: str = "direct",
    on_head_node: bool = False,
) -> None:
    """Deploy the application and wait until /health says every engine replica can serve.
    ``layout``, unless ``args`` names one: the shipped config's (``direct``: engine replicas
    serve HTTP behind HAProxy; with several, HAProxy asks the replica chooser) or ``routed``.
    ``on_head_node``: the engine replicas all run on the head node (see ``HEAD_RESOURCE``)."""
    from ray import serve

    from deployments.app import build
    from deployments.config import AppArgs

    app = build(
        AppArgs.model_validate({"layout": layout, **args}),
        engine_options={
            # An autoscaling_config in engine_options replaces the fixed replica count.
            **(
                {}
                if "autoscaling_config" in (engine_options or {})
                else {"num_replicas": num_replicas}
            ),
            "ray_actor_options": {
                "num_cpus": engine_num_cpus,
                **(ON_HEAD_NODE if on_head_node else {}),
            },
            **(engine_options or {}),
        },
        ingress_options={"ray_actor_options": {"num_cpus": 0}},
    )
    serve.run(app, name=name, route_prefix="/", blocking=False)
    # /health is behind the API key when the app has one.
    headers = {"Authorization": f"Bearer {args['api_key']}"} if args.get("api_key") else {}
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base_url}/health", headers=headers, timeout=10)
            last = r.text
            if r.status_code == 200 and r.json().get("replicas", {}).get("RUNNING") == num_replicas:
                return
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1.0)
    raise TimeoutError(f"application not healthy after {timeout_s}s: {last}")


def replica_states(app: str, deployment: str = "Engine") -> dict[str, int]:
    """How many of the deployment's replicas are in each state (``RUNNING``, ``STARTING``...)."""
    from ray import serve

    return dict(serve.status().applications[app].deployments[deployment].replica_states)


def undeploy(name: str = "prefixserve") -> None:
    from ray import serve

    serve.delete(name)


@pytest.fixture(scope="session")
def tiny_validator(tiny_llama_with_tokenizer: Any) -> Any:
    """The request validator of a tiny model with SmolLM2's tokenizer and chat template
    (stateless per request, so one serves every test that does not change it)."""
    from deployments.config import AppArgs
    from deployments.validation import RequestValidator

    return RequestValidator(
        AppArgs.model_validate({"model": str(tiny_llama_with_tokenizer), "served_model_name": "m"})
    )


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_with_tokenizer: Any) -> Any:
    """That model's tokenizer, loaded apart from the validator's: the reference to compare with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)
