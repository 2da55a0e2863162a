"""The benchmark client end to end against a fake streaming server over real sockets."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import serve
from benchmarks.client import ClientConfig
from benchmarks.workloads import random_requests, shared_prefix_requests
from tests.benchmarks.fake_openai_server import MODEL, FakeServer, RunningFakeServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with RunningFakeServer(FakeServer()) as fake:
        yield fake


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    fake_server.reset()
    return fake_server


def _expected_from_log(fake: FakeServer) -> dict:
    ok = [e for e in fake.log if e["outcome"] == "ok"]
    replicas = Counter(e["replica"] for e in fake.log)
    return {
        "completed": len(ok),
        "failed": len(fake.log) - len(ok),
        "output_tokens": sum(e["completion_tokens"] for e in ok),
        "input_tokens": sum(e["prompt_tokens"] for e in ok),
        "chunks": sum(e["chunks"] for e in ok),
        "hit_ratio": sum(e["cached"] for e in ok) / sum(e["prompt_tokens"] for e in ok),
        "replicas": dict(replicas),
        "max_share": max(replicas.values()) / len(fake.log),
    }


def test_cli_random_completions(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "res" / "summary.json"
    argv = [
        "--base-url", fake.base_url, "--num-prompts", "20", "--concurrency", "4",
        "--input-len-min", "20", "--input-len-max", "40", "--output-len", "6",
        "--ignore-eos", "--seed", "7", "--disable-tqdm", "--output-json", str(out), "--save-requests",
    ]  # fmt: skip
    summary = serve.main(argv)
    stdout = capsys.readouterr().out.strip().splitlines()
    assert json.loads(stdout[-1]) == summary

    exp = _expected_from_log(fake)
    assert len(fake.log) == 20 and 0 < exp["failed"] < 20
    assert summary["model"] == MODEL  # discovered through GET /v1/models
    assert (summary["completed"], summary["failed"]) == (exp["completed"], exp["failed"])
    assert summary["cancelled"] == summary["not_sent"] == 0
    assert summary["total_output_tokens"] == exp["output_tokens"] == 6 * exp["completed"]
    assert summary["total_input_tokens"] == exp["input_tokens"]
    assert summary["prefix_cache_hit_ratio"] == pytest.approx(exp["hit_ratio"])
    assert summary["replicas"]["counts"] == exp["replicas"]
    assert summary["replicas"]["max_share"] == pytest.approx(exp["max_share"])
    assert summary["tokens_per_chunk"] == pytest.approx(exp["output_tokens"] / exp["chunks"])
    assert summary["itl_ms"]["count"] == exp["chunks"] - exp["completed"]
    # TTFT is timed from the send: it includes the server's 20 ms before the first token.
    assert summary["ttft_ms"]["min"] >= 20.0
    assert summary["e2e_latency_ms"]["min"] >= summary["ttft_ms"]["min"]
    assert set(summary["errors"]) == {
        "HTTP 429: engine overloaded (Retry-After: 1)",
        "stream error: replica died",
    }
    # What the server received: the workload's token ids and the sampling knobs.
    workload = random_requests(20, input_len_min=20, input_len_max=40, output_len=6, seed=7)
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(r.prompt_token_ids for r in workload)
    for body in fake.bodies:
        assert body["max_tokens"] == 6 and body["temperature"] == 0.0 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == MODEL

    document = json.loads(out.read_text())
    assert document["summary"]["completed"] == exp["completed"]
    assert document["config"]["num_prompts"] == 20
    per_request = document["requests"]
    assert sorted(r["index"] for r in per_request) == list(range(20))
    assert Counter(r["outcome"] for r in per_request) == Counter(e["outcome"] for e in fake.log)


def test_chat_shared_prefix(fake: FakeServer) -> None:
    reqs = shared_prefix_requests(
        num_groups=2, prompts_per_group=3, prefix_len=10, question_len=4, output_len=5
    )
    config = ClientConfig(base_url=fake.base_url + "/v1", model=MODEL, endpoint="chat")
    run = asyncio.run(serve.run_benchmark(reqs, config, concurrency=2, progress=False))
    summary = run.summary()
    exp = _expected_from_log(fake)
    assert (summary["completed"], summary["failed"]) == (exp["completed"], exp["failed"]) == (4, 2)
    # The role-only first chunk is not content: chunk counts match what the fake sent.
    assert sum(r.num_chunks for r in run.results if r.outcome == "ok") == exp["chunks"]
    assert all(r.output_text.split() == ["tok"] * 5 for r in run.results if r.outcome == "ok")
    assert summary["prefix_cache_hit_ratio"] == pytest.approx(exp["hit_ratio"])
    systems = Counter(b["messages"][0]["content"] for b in fake.bodies)
    assert sorted(systems.values()) == [3, 3]
    assert all(b["messages"][0]["role"] == "system" for b in fake.bodies)
    assert len({b["messages"][1]["content"] for b in fake.bodies}) == 6


def test_run_time_limit_cancels_and_drops(fake: FakeServer) -> None:
    reqs = random_requests(6, output_len=50)
    config = ClientConfig(base_url=fake.base_url, model=MODEL, extra_body={"fake_token_delay": 0.5})
    run = asyncio.run(
        serve.run_benchmark(reqs, config, concurrency=2, max_duration=0.5, progress=False)
    )
    summary = run.summary()
    # Two requests were in flight (the rest waited for a slot) when time ran out.
    assert (summary["cancelled"], summary["not_sent"], summary["completed"]) == (2, 4, 0)
    assert 0.5 <= summary["duration_s"] < 2.0
    assert all(r.error == "cancelled at the run time limit" for r in run.results)
