"""Prefix-aware routing across two engine replicas, end to end."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import deploy, replica_states, undeploy

pytestmark = pytest.mark.ray

APP = "routing"
BLOCK = 16


async def _run(
    base_url: str, prompts: list[list[int]], concurrency: int, max_tokens: int = 4
) -> list[dict]:
    """Send the prompts in order with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = [{}] * len(prompts)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with sem:
            body = {
                "model": "tiny",
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(f"{base_url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            results[i] = {
                "replica": r.headers["x-engine-replica"],
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            }

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i, client)))
            await asyncio.sleep(0.05)  # keep the arrival order
        await asyncio.gather(*tasks)
    return results


def _wait_for_one_router(timeout_s: float = 60.0) -> None:
    """Serve starts a chooser per node holding a replica of any application: wait until only
    this application's head-node one runs (another module's app on the second node would add
    one)."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, int] = {}
    while time.monotonic() < deadline:
        states = replica_states(APP, "Router")
        if states == {"RUNNING": 1}:
            return
        time.sleep(0.5)
    raise AssertionError(f"expected one replica chooser, got {states}")


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path):
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "num_kv_blocks": 1024, "max_num_seqs": 16},
            "routing_policy": "prefix_aware",
            # Reports four times a second: the router counts the prefill of requests it has no
            # completion for until the next report, and these requests last ~50 ms, so with the
            # default 1 s a burst of new prefixes could make a holder look busier than
            # recomputing a prefix elsewhere.
            "router": {"stats_period_s": 0.25},
            # Routing alone must find the cached prefixes: no imports from the other replica.
            "kv_sharing": {"enabled": False},
        },
        name=APP,
        # One node, so one replica chooser routes every request, as behind one HAProxy; the
        # choices of several routers that share no memory are not what these tests check.
        on_head_node=True,
    )
    _wait_for_one_router()
    yield serve_instance
    undeploy(APP)


def test_shared_prefixes_follow_their_cache(base_url: str) -> None:
    rng = random.Random(11)
    groups, per_group, prefix_len, question_len = 6, 5, 520, 24
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(groups)]
    # Interleaved arrivals: g0, g1, ..., g5, g0, g1, ...
    prompts = [
        prefixes[g] + [rng.randrange(100, 40000) for _ in range(question_len)]
        for _ in range(per_group)
        for g in range(groups)
    ]
    results = asyncio.run(_run(base_url, prompts, concurrency=2))

    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    # Best achievable: every request but the first of its group hits the prefix's full blocks.
    best = (prefix_len // BLOCK * BLOCK) * (per_group - 1) * groups
    assert cached >= 0.8 * best, (cached, best, prompt_tokens)

    # Each group stayed together, and the groups did not all pile onto one replica.
    by_group = collections.defaultdict(set)
    for i, r in enumerate(results):
        by_group[i % groups].add(r["replica"])
    homes = collections.Counter(next(iter(s)) for s in by_group.values() if len(s) == 1)
    assert sum(homes.values()) >= groups - 1
    assert len({r["replica"] for r in results}) == 2


def test_unrelated_prompts_spread(base_url: str) -> None:
    rng = random.Random(12)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 120))] for _ in range(40)
    ]
    # Long enough that requests overlap (128 tokens: ~250 ms each, arrivals 50 ms apart), so the
    # router's load estimate decides. With 16 tokens a request took ~35 ms, over before the next
    # arrived: both replicas looked idle and the split drifted as far as 30 / 10.
    results = asyncio.run(_run(base_url, prompts, concurrency=4, max_tokens=128))
    counts = collections.Counter(r["replica"] for r in results)
    assert len(counts) == 2
    assert max(counts.values()) <= 0.65 * len(prompts), counts


def test_a_sessions_turns_return_to_its_replica(base_url: str) -> None:
    """Turn 2 of each session shares no prefix with turn 1, so without the session (Serve's
    x-session-id header, or the OpenAI ``user`` field) it would land by load alone: with both
    replicas idle, on either one (six sessions all returning by chance: 1 in 64)."""
    rng = random.Random(13)

    def send(client: httpx.Client, session: int) -> str:
        body = {
            "model": "tiny",
            "prompt": [rng.randrange(100, 40000) for _ in range(320)],
            "max_tokens": 2,
            "temperature": 0,
        }
        headers = {}
        if session % 2:
            headers["x-session-id"] = f"conversation-{session}"
        else:
            body["user"] = f"user-{session}"
        r = client.post(f"{base_url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.headers["x-engine-replica"]

    with httpx.Client(timeout=120) as client:
        first = {s: send(client, s) for s in range(6)}
        # Past the router's 5 s hold on a ranked request, so the first turns no longer count as
        # load on their replicas.
        time.sleep(6)
        second = {s: send(client, s) for s in range(6)}
    assert second == first


def test_a_hot_prefix_is_served_from_two_replicas(base_url: str) -> None:
    """One system prompt asked for many times a second (the prefix becomes hot, past
    ``hot_prefix_rate``): a second replica takes a copy and serves it from its cache too, while
    load alone (8 in flight, under the imbalance guard's 8) would not move it."""
    rng = random.Random(17)
    system = [rng.randrange(100, 40000) for _ in range(480)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(16)] for _ in range(32)]
    results = asyncio.run(_run(base_url, prompts, concurrency=8, max_tokens=8))
    full = 480 // BLOCK * BLOCK
    hits = collections.Counter(r["replica"] for r in results if r["cached_tokens"] >= full)
    assert len(hits) == 2, hits
