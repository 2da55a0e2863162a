"""Start and stop a local prefixserve service for benchmarks (``serve run`` on a config variant)."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.servers import server_env, stop_session

ROOT = Path(__file__).resolve().parent.parent


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``changes`` into a copy of ``base``."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# The shipped config runs one engine replica on both cores; benchmarks of routing and KV sharing
# need two, a core each.
TWO_REPLICAS = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}}


def config_variant(
    args: dict[str, Any] | None = None,
    engine_deployment: dict[str, Any] | None = None,
    base: Path = ROOT / "serve_config.yaml",
) -> dict[str, Any]:
    """``serve_config.yaml`` with its application's ``args`` and the Engine deployment's options
    changed."""
    config = yaml.safe_load(base.read_text())
    app = config["applications"][0]
    app["args"] = merge(app.get("args") or {}, args or {})
    if engine_deployment:
        for dep in app.get("deployments", []):
            if dep["name"] == "Engine":
                dep.update(engine_deployment)
    return config


def wait_healthy(base_url: str, replicas: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(f"{base_url}/health", timeout=5)
            if r.status_code == 200 and r.json()["replicas"].get("RUNNING") == replicas:
                return
        time.sleep(1.0)
    raise TimeoutError(f"service not healthy within {timeout_s}s")


@contextlib.contextmanager
def running_service(
    config: dict[str, Any],
    replicas: int = 2,
    port: int = 8000,
    timeout_s: float = 300,
    log_path: Path | None = None,
) -> Iterator[str]:
    """Run ``serve run`` on ``config``; yields the base URL once every engine replica serves."""
    config = merge(config, {"http_options": {"port": port}})
    # The environment `make serve` gives the server (direct ingress needs HAProxy turned on).
    env = server_env({**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
        path = f.name
    log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed below
    serve_bin = Path(sys.executable).with_name("serve")
    proc = subprocess.Popen(
        # A cluster of its own, never one already running here.
        [str(serve_bin), "run", "--address", "local", path],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, replicas, timeout_s, proc)
        yield base_url
    finally:
        # `serve run` started its own local cluster, which ends with it (and any process of its
        # session left behind): no `ray stop`, which would also end every other Ray cluster here.
        stop_session(proc, "serve run")
        log.close()
        os.unlink(path)
