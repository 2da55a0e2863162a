"""The engine deployment scales out under a burst and back in when it ends."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import deploy, replica_states, undeploy

pytestmark = pytest.mark.ray

APP = "autoscale"


def _engine_replicas() -> dict[str, int]:
    return replica_states(APP)


def _wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - start


def test_scales_up_under_burst_and_back_down(serve_instance: str, tiny_llama_with_tokenizer: Path):
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 16},
            "kv_sharing": {"enabled": False},
        },
        name=APP,
        num_replicas=1,
        engine_options={
            "autoscaling_config": {
                "min_replicas": 1,
                "max_replicas": 2,
                "initial_replicas": 1,
                "target_ongoing_requests": 2,
                "upscale_delay_s": 1.0,
                "downscale_delay_s": 4.0,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2.0,
            }
        },
    )
    try:
        assert _engine_replicas().get("RUNNING") == 1
        stop = threading.Event()
        served_by: set[str] = set()

        def client() -> None:
            body = {
                "model": "tiny",
                "prompt": "keep the engine busy",
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
            }
            with httpx.Client(timeout=120) as c:
                while not stop.is_set():
                    r = c.post(f"{serve_instance}/v1/completions", json=body)
                    if r.status_code == 200:
                        served_by.add(r.headers["x-engine-replica"])

        threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        try:
            up = _wait_for(lambda: _engine_replicas().get("RUNNING", 0) == 2, 120, "scale-up")
            # Both replicas serve the burst once the new one is up.
            _wait_for(lambda: len(served_by) == 2, 60, "the new replica to serve")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        down = _wait_for(lambda: _engine_replicas() == {"RUNNING": 1}, 120, "scale-down")
        print(f"scaled up after {up:.1f}s of burst, back down {down:.1f}s after it ended")
        r = httpx.post(
            f"{serve_instance}/v1/completions",
            json={"model": "tiny", "prompt": "still there?", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        undeploy(APP)
