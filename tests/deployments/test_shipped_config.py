"""The shipped ``serve_config.yaml`` as a user runs it: its app args and deployment options, the
default model, over HTTP through Serve's direct ingress, driven by the benchmark client with a
shared-prefix workload. Asserts what must hold on any machine: no failed request, the prefix
cache serving the shared prefixes, and nothing left behind (no timings)."""

from __future__ import annotations

import asyncio
import collections
import importlib.metadata
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks import serve as bench
from tests.deployments.conftest import deploy, undeploy
from tests.deployments.support import scrape, wait_until_idle

pytestmark = pytest.mark.ray

APP = "shipped"
CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"
# More than the limits' default max_queued_at_proxy (64).
BURST = 100


def shipped() -> tuple[dict[str, Any], dict[str, Any]]:
    """The config's app args and its Engine deployment's options."""
    app = yaml.safe_load(CONFIG.read_text())["applications"][0]
    engine = next(d for d in app["deployments"] if d["name"] == "Engine")
    return app["args"], engine


@pytest.fixture(scope="module")
def base_url(serve_instance: str, smollm2_dir: Path):
    args, engine = shipped()
    assert args["layout"] == "direct"
    options = {k: v for k, v in engine.items() if k not in ("name", "ray_actor_options")}
    deploy(
        serve_instance,
        # A smaller KV cache than the laptop's: the test cluster shares 24 GB with the suite.
        {**args, "engine": {**args["engine"], "kv_cache_memory_gb": 0.25}},
        name=APP,
        num_replicas=options.pop("num_replicas"),
        engine_num_cpus=engine["ray_actor_options"]["num_cpus"],
        engine_options=options,
    )
    yield serve_instance
    undeploy(APP)


def test_shared_prefix_workload_hits_the_cache_and_nothing_fails(base_url: str) -> None:
    groups, per_group, prefix_len = 4, 6, 256
    summary = bench.main(
        [
            "--base-url", base_url, "--workload", "shared-prefix",
            "--num-groups", str(groups), "--prompts-per-group", str(per_group),
            "--prefix-len", str(prefix_len), "--question-len", "16", "--output-len", "8",
            "--concurrency", "6", "--ignore-eos", "--seed", "3", "--disable-tqdm",
        ]
    )  # fmt: skip
    assert summary["failed"] == 0 and summary["cancelled"] == 0, summary["errors"]
    assert summary["completed"] == groups * per_group
    assert summary["total_output_tokens"] == groups * per_group * 8
    # Every prompt but the first of its group finds its group's prefix cached: all but whole
    # blocks of the prefix (16 tokens each) and the odd token the chat template adds.
    ideal = groups * (per_group - 1) * (prefix_len // 16 * 16) / summary["total_input_tokens"]
    assert summary["prefix_cache_hit_ratio"] >= 0.8 * ideal, summary
    # One replica served everything, and it holds nothing once the streams ended.
    assert summary["replicas"]["num_replicas"] == 1
    idle = wait_until_idle(base_url)
    assert all(v == 0 for v in idle.values()), idle
    assert scrape(base_url)  # /metrics answers on the direct path too
    version = httpx.get(f"{base_url}/version", timeout=30)
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("prefixserve")}


def test_a_burst_of_probes_is_served_not_refused(base_url: str) -> None:
    """100 concurrent probes at once, as a load balancer's or a monitoring burst: every one is
    answered 200 (Serve's direct ingress counted each arrival as queued until it held a slot,
    so a queue limit below the burst refused some with 429 while every slot was free)."""

    async def burst(path: str) -> collections.Counter[int]:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            codes = await asyncio.gather(*(client.get(path) for _ in range(BURST)))
        return collections.Counter(r.status_code for r in codes)

    for path in ("/ping", "/health"):
        assert asyncio.run(burst(path)) == {200: BURST}, path
