"""One request's ids followed through the Serve log files of the replicas that served it, and
the engine stats line (real Ray Serve; the engine replicas log JSON, an ingress text). Routed:
the ingress's and the engine replica's files; direct (the shipped layout): the engine replica's,
which serves HTTP itself."""

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


@pytest.fixture(scope="module", params=["routed", "direct"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path, layout: str) -> Iterator[str]:
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
        layout=layout,
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


def test_one_request_followed_through_its_replicas_logs(base_url: str, layout: str) -> None:
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

    # The HTTP side's request line: text at a routed ingress, JSON in the direct layout.
    if layout == "routed":
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

    expected = ["engine request added", "engine request finished"]
    if layout == "direct":
        expected.append("received chat completion request")

    def complete() -> list[dict]:
        records = engine_records()
        found = all(any(e in rec["message"] for rec in records) for e in expected)
        return records if found else []

    records = wait_for(complete)
    messages = [rec["message"] for rec in records]
    assert records, (expected, [r["message"] for r in engine_records()])
    finished = [m for m in messages if "engine request finished" in m]
    assert "output_tokens=5" in finished[0]
    for rec in records:
        assert rec["response_id"] == response_id and rec["x_request_id"] == x_request_id
        assert rec["message"].startswith(f"[{response_id} x-request-id={x_request_id}] ")

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
