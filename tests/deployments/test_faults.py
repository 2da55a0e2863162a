"""Faults: an engine replica killed mid-stream, and an engine loop that dies.

Live greedy streams on a killed replica are resumed on the other one and end as an undisturbed
run would (deployments.failover); streams on a replica whose engine loop failed end with an SSE
error event within seconds (the request may be what broke it). Either way new requests must
succeed on the surviving replica at once, Serve must bring up a replacement, and the KV
directory and the metrics registry must forget the dead replica.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.deployments.conftest import deploy, replica_states, undeploy
from tests.deployments.support import (
    engine_replica_ids,
    scrape,
    sse_payloads,
    total,
    wait_until_idle,
)

pytestmark = pytest.mark.ray

APP = "prefixserve"
STREAMS = 8
ERROR_WITHIN_S = 5.0
REPLACED_WITHIN_S = 60.0
# Sixteen full blocks of 16 tokens: enough that routing keeps a shared prefix on one replica.
PREFIX = [random.Random(7).randrange(3, 49000) for _ in range(256)]


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path) -> Iterator[str]:
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 16},
            # Cache affinity outweighs load here, so that the streams share one replica.
            "router": {"load_cost_per_request": 0.25, "imbalance_abs": 64},
            "kv_sharing": {"min_blocks": 4},
            "stream_interval_ms": 5,
        },
        # Failover of a stream already under way: the ingress resumes it on another replica or
        # ends it with an error event. Behind HAProxy alone a dead replica's streams just end.
        layout="routed",
    )
    yield serve_instance
    undeploy()


def replica_actor(replica_id: str) -> Any:
    return ray.get_actor(f"SERVE_REPLICA::{APP}#Engine#{replica_id}", namespace="serve")


def running_engine_replicas() -> int:
    return replica_states(APP).get("RUNNING", 0)


@dataclass
class StreamLog:
    replica: str = ""
    data_events: int = 0
    error: dict[str, Any] | None = None
    error_at: float | None = None
    finish_reason: str | None = None
    text: str = ""
    done: bool = False
    events: list[Any] = field(default_factory=list)


def long_request(suffix: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": PREFIX + [suffix],
        "max_tokens": 700,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def long_stream(client: httpx.AsyncClient, suffix: int, log: StreamLog) -> None:
    body = long_request(suffix, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        log.replica = r.headers["x-engine-replica"]
        async for line in r.aiter_lines():
            for event in sse_payloads([line]):
                log.events.append(event)
                if event == "[DONE]":
                    log.done = True
                elif "error" in event:
                    log.error, log.error_at = event["error"], time.monotonic()
                else:
                    log.data_events += 1
                    choice = event["choices"][0]
                    log.text += choice["text"]
                    log.finish_reason = choice["finish_reason"] or log.finish_reason


async def short_request(client: httpx.AsyncClient, rng: random.Random) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": [rng.randrange(3, 49000) for _ in range(12)],
        "max_tokens": 4,
        "temperature": 0,
    }
    return await client.post("/v1/completions", json=body)


async def open_streams(
    client: httpx.AsyncClient, n: int
) -> tuple[list[StreamLog], list[asyncio.Task], str]:
    """Open ``n`` long streams sharing PREFIX and wait until each has produced tokens; returns
    their logs, their tasks and the replica serving most of them."""
    # Put the prefix in one replica's cache first: the router then sends the streams there.
    warm = {"model": "tiny", "prompt": PREFIX, "max_tokens": 1}
    assert (await client.post("/v1/completions", json=warm)).status_code == 200
    logs = [StreamLog() for _ in range(n)]
    tasks = [asyncio.create_task(long_stream(client, i, log)) for i, log in enumerate(logs)]
    deadline = time.monotonic() + 60
    while not all(log.data_events >= 3 for log in logs):
        assert time.monotonic() < deadline, [log.data_events for log in logs]
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        await asyncio.sleep(0.05)
    replicas = [log.replica for log in logs]
    return logs, tasks, max(set(replicas), key=replicas.count)


async def streams_then_fault(
    base_url: str, fault: Any
) -> tuple[list[StreamLog], float, list[httpx.Response]]:
    """Open STREAMS long streams sharing PREFIX, apply ``fault(replica_id)`` to the replica
    serving most of them once they all produce tokens, then send 20 short requests."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        logs, tasks, victim = await open_streams(client, STREAMS)
        await asyncio.to_thread(fault, victim)
        fault_at = time.monotonic()
        rng = random.Random(3)
        after = [await short_request(client, rng) for _ in range(20)]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        return logs, fault_at, after


def wait_for_replacement(base_url: str, dead: str, since: float) -> tuple[str, float]:
    """Send requests until one is served by an engine replica that did not exist before."""

    async def batch(client: httpx.AsyncClient, rng: random.Random) -> set[str]:
        # Concurrent, so that the router spreads them over both replicas.
        rs = await asyncio.gather(*(short_request(client, rng) for _ in range(6)))
        assert [r.status_code for r in rs] == [200] * len(rs)
        return {r.headers["x-engine-replica"] for r in rs}

    async def run() -> tuple[str, float]:
        rng = random.Random(5)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            while time.monotonic() - since < REPLACED_WITHIN_S + 30:
                if running_engine_replicas() == 2:
                    new = await batch(client, rng) - {dead} - survivors
                    if new:
                        return new.pop(), time.monotonic() - since
                await asyncio.sleep(0.5)
        raise AssertionError(f"no replacement for {dead} after {time.monotonic() - since:.0f} s")

    survivors = engine_replica_ids(scrape(base_url)) - {dead}
    return asyncio.run(run())


async def undisturbed_texts(base_url: str) -> list[str]:
    """The long streams' texts from a run with no fault (whole answers, side by side)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        rs = await asyncio.gather(
            *(client.post("/v1/completions", json=long_request(i, False)) for i in range(STREAMS))
        )
    assert [r.status_code for r in rs] == [200] * STREAMS
    return [r.json()["choices"][0]["text"] for r in rs]


def test_replica_killed_mid_stream_resumes_its_streams(base_url: str) -> None:
    """Every greedy stream on the killed replica continues on the other one: no error, no
    repeated or missing character, the undisturbed text, and the failovers are counted."""
    before = engine_replica_ids(scrape(base_url))
    assert len(before) == 2
    handle = serve.get_deployment_handle("Engine", app_name=APP)
    expected = asyncio.run(undisturbed_texts(base_url))
    failovers = total(scrape(base_url), "prefixserve_failovers_total")

    def kill(replica_id: str) -> None:
        ray.kill(replica_actor(replica_id), no_restart=True)

    logs, killed_at, after = asyncio.run(streams_then_fault(base_url, kill))
    victim = max({log.replica for log in logs}, key=[log.replica for log in logs].count)
    hit = [log for log in logs if log.replica == victim]
    assert hit and all(log.data_events >= 3 for log in hit)
    for i, log in enumerate(logs):
        assert log.error is None, (i, log.error)
        assert log.done and log.finish_reason == "length"
        seam = next(
            (j for j, (a, b) in enumerate(zip(log.text, expected[i], strict=False)) if a != b), None
        )
        assert log.text == expected[i], (i, len(log.text), len(expected[i]), seam)
    assert total(scrape(base_url), "prefixserve_failovers_total") - failovers == len(hit)
    # New requests go to the living replica at once.
    assert [r.status_code for r in after] == [200] * 20
    assert victim not in {r.headers["x-engine-replica"] for r in after}

    new, took = wait_for_replacement(base_url, victim, killed_at)
    # The KV directory and the metrics registry forget the dead replica.
    deadline = time.monotonic() + 40
    while True:
        owners = asyncio.run(_directory_owners(handle))
        reported = engine_replica_ids(scrape(base_url))
        if victim not in owners and victim not in reported:
            break
        assert time.monotonic() < deadline, (owners, reported)
        time.sleep(1)
    assert not any(wait_until_idle(base_url).values())
    print(
        f"\nkill: {len(hit)} streams on the killed replica resumed and finished with the "
        f"undisturbed text, {STREAMS - len(hit)} on the other finished; 20/20 requests after the "
        f"kill succeeded; replacement {new} served after {took:.1f} s"
    )


async def _directory_owners(handle: Any) -> dict[str, int]:
    stats = await handle.kv_directory_stats.remote()
    return stats.get("owners", {})


def inject_step_fault(replica_id: str) -> None:
    """Make the replica's engine loop raise on its next step (test-only, via the actor)."""

    def patch(actor: Any) -> str:
        replica = actor._replica_impl._user_callable_wrapper._callable

        def broken_step() -> list:
            raise RuntimeError("injected fault: engine step failed")

        replica.engine.step = broken_step
        return replica.replica_id

    assert ray.get(replica_actor(replica_id).__ray_call__.remote(patch)) == replica_id


def test_engine_loop_fault_fails_streams_and_replica_is_replaced(base_url: str) -> None:
    assert running_engine_replicas() == 2
    logs, fault_at, after = asyncio.run(streams_then_fault(base_url, inject_step_fault))
    victim = max({log.replica for log in logs}, key=[log.replica for log in logs].count)
    hit = [log for log in logs if log.replica == victim]
    for log in hit:
        assert log.done, log.events[-2:]
        if log.error is None:
            # The replica's exit overtook the engine's error item: the stream died with the
            # replica, so it was resumed elsewhere like a killed one.
            assert log.finish_reason == "length", log.events[-2:]
            continue
        # The engine's own error, or the replica's exit if that overtook it and resuming failed.
        assert "injected fault" in log.error["message"] or log.error["code"] == (
            "engine_unavailable"
        ), log.error
        assert log.error_at - fault_at <= ERROR_WITHIN_S
    # The broken replica takes itself down: requests sent its way fail over to the other one.
    assert [r.status_code for r in after] == [200] * 20
    assert victim not in {r.headers["x-engine-replica"] for r in after}
    new, took = wait_for_replacement(base_url, victim, fault_at)
    deadline = time.monotonic() + 30
    while victim in engine_replica_ids(scrape(base_url)):
        assert time.monotonic() < deadline
        time.sleep(1)
    assert not any(wait_until_idle(base_url).values())
    print(
        f"\nengine fault: {len(hit)} streams ended with an error event; replica {victim} "
        f"replaced by {new}, serving after {took:.1f} s"
    )
