"""One request's ids followed through the ingress's and the engine replica's Serve log files,
and the engine stats line (real Ray Serve, the routed layout; the engine logs JSON)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import deploy, undeploy

pytestmark = pytest.mark.ray

APP = "prefixserve-logs"


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path) -> Iterator[str]:
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "num_kv_blocks": 128, "max_num_seqs": 8},
            "kv_sharing": {"enabled": False},
            "enable_log_requests": True,
            "log_stats_interval_s": 1.0,
        },
        name=APP,
        num_replicas=1,
        layout="routed",
        engine_options={"logging_config": {"encoding": "JSON"}},
    )
    yield serve_instance
    undeploy(APP)


def serve_logs(component: str) -> list[str]:
    """Lines of this cluster's Serve log files of ``component``'s replicas of the app."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    lines: list[str] = []
    for path in sorted(logs.glob(f"replica_{APP}_{component}_*.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_one_request_followed_through_ingress_and_engine_logs(base_url: str) -> None:
    x_request_id = f"trace-{time.time_ns()}"
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"x-request-id": x_request_id},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    )
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    response_id = chunks[0]["id"]
    assert response_id.startswith("chatcmpl-")
    assert r.headers["x-request-id"] == x_request_id

    # The ingress (text): its request line carries both ids, and so does every line naming one.
    ingress = wait_for(lambda: [x for x in serve_logs("Ingress") if response_id in x])
    assert any("received chat completion request" in line for line in ingress), ingress
    assert all(f"[{response_id} x-request-id={x_request_id}]" in line for line in ingress)

    # The engine replica (JSON): the ids as keys of each of the request's records.
    def engine_records() -> list[dict]:
        out = []
        for line in serve_logs("Engine"):
            if line.startswith("{") and response_id in line:
                out.append(json.loads(line))
        return out

    records = wait_for(lambda: len(engine_records()) >= 2 and engine_records())
    messages = [rec["message"] for rec in records]
    assert any("engine request added" in m for m in messages), messages
    finished = [m for m in messages if "engine request finished" in m]
    assert finished and "output_tokens=5" in finished[0]
    for rec in records:
        assert rec["response_id"] == response_id and rec["x_request_id"] == x_request_id

    # The stats line, from the engine replica's report loop (outside any request).
    stats = wait_for(
        lambda: [
            json.loads(line)
            for line in serve_logs("Engine")
            if line.startswith("{") and "engine stats:" in line
        ]
    )
    assert stats, "no engine stats line"
    assert (
        "generation_tok/s=" in stats[-1]["message"] and "prefix_hit_ratio=" in stats[-1]["message"]
    )
    assert all("response_id" not in rec for rec in stats)
