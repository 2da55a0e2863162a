"""Prefix KV blocks shared between replicas through Ray's object store, end to end."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from tests.deployments.conftest import deploy, undeploy
from tests.deployments.support import wait_until_idle
from tests.deployments.test_serving import metrics, total

pytestmark = pytest.mark.ray

APP = "kvshare"


def _args(model: Path) -> dict:
    return {
        "model": str(model),
        "served_model_name": "tiny",
        "engine": {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 8},
        "routing_policy": "round_robin",
        "kv_sharing": {"enabled": True, "min_blocks": 4},
    }


def _complete(base_url: str, prompt: list[int]) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _directory_stats() -> dict:
    handle = serve.get_deployment_handle("Engine", APP)
    return handle.kv_directory_stats.remote().result()


def _wait_published(min_entries: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _directory_stats()
        if stats["entries"] >= min_entries:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.3)


def _on_other_replica(base_url: str, prompt: list[int], first_replica: str) -> httpx.Response:
    """Send ``prompt`` until a replica other than ``first_replica`` serves it."""
    for _ in range(12):
        r = _complete(base_url, prompt)
        if r.headers["x-engine-replica"] != first_replica:
            return r
    raise AssertionError("every request went to the same replica")


@pytest.mark.parametrize("placement", ["same-node", "two-nodes"])
def test_second_replica_imports_prefix(serve_instance, tiny_llama_with_tokenizer, placement):
    options = {"max_replicas_per_node": 1} if placement == "two-nodes" else {}
    deploy(serve_instance, _args(tiny_llama_with_tokenizer), name=APP, engine_options=options)
    try:
        if placement == "two-nodes":
            handle = serve.get_deployment_handle("Engine", APP)
            reports = handle.cluster_report.remote().result()
            assert len({r["node_id"] for r in reports.values()}) == 2
            # The routers learn each replica's real node from its routing stats.
            stats = {}
            for _ in range(20):
                report = handle.record_routing_stats.remote().result()
                stats[report["replica_id"]] = report["node_id"]
                if len(stats) == 2:
                    break
            assert stats == {rid: r["node_id"] for rid, r in reports.items()}
            assert set(stats.values()) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        rng = random.Random(5)
        prompt = [rng.randrange(100, 40000) for _ in range(600)]
        cold = _complete(serve_instance, prompt)
        replica_a = cold.headers["x-engine-replica"]
        assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        _wait_published(min_entries=37)  # 600 tokens = 37 full blocks of 16
        before = total(
            metrics(serve_instance), "prefixserve_prefix_cache_hit_tokens_total", source="remote"
        )

        warm = _on_other_replica(serve_instance, prompt, replica_a)
        cached = warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 512
        assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        # Replicas report metrics about once a second.
        deadline = time.monotonic() + 10
        while True:
            after = total(
                metrics(serve_instance),
                "prefixserve_prefix_cache_hit_tokens_total",
                source="remote",
            )
            if after - before >= cached or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert after - before == cached
    finally:
        undeploy(APP)


def test_owner_death_falls_back_to_recompute(serve_instance, tiny_llama_with_tokenizer):
    deploy(serve_instance, _args(tiny_llama_with_tokenizer), name=APP)
    try:
        rng = random.Random(6)
        prompt = [rng.randrange(100, 40000) for _ in range(300)]
        cold = _complete(serve_instance, prompt)
        owner = cold.headers["x-engine-replica"]
        stats = _wait_published(min_entries=18)
        assert stats["owners"].get(owner, 0) >= 18

        actor = next(
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].endswith(owner) and "Engine" in a["name"]
        )
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)

        # Later requests with the same prefix still succeed (recomputed where needed) ...
        for _ in range(4):
            r = _complete(serve_instance, prompt)
            assert r.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        # ... and the directory forgets the dead replica's blocks.
        deadline = time.monotonic() + 60
        while _directory_stats()["owners"].get(owner, 0):
            assert time.monotonic() < deadline, "dead owner's entries were not dropped"
            time.sleep(1.0)
    finally:
        undeploy(APP)


def _directory_actor() -> ray.actor.ActorHandle:
    (actor,) = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "kv_directory" in a["name"] and APP in a["name"]
    ]
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def _remote_hits(base_url: str) -> float:
    return total(metrics(base_url), "prefixserve_prefix_cache_hit_tokens_total", source="remote")


def test_directory_death_is_survived(serve_instance, tiny_llama_with_tokenizer):
    """The directory actor dies under traffic: no request fails, /health recovers within 10 s,
    and sharing resumes once Serve has recreated the actor."""
    deploy(serve_instance, _args(tiny_llama_with_tokenizer), name=APP)
    try:
        rng = random.Random(8)
        before = [rng.randrange(100, 40000) for _ in range(300)]
        _complete(serve_instance, before)
        _wait_published(min_entries=18)

        ray.kill(_directory_actor(), no_restart=True)
        killed_at = time.monotonic()
        healthy_at = None
        # Traffic right through the loss: every request succeeds (recomputing what it must).
        while time.monotonic() - killed_at < 12:
            _complete(serve_instance, before)
            r = httpx.get(f"{serve_instance}/health", timeout=30)
            if r.status_code == 200 and healthy_at is None:
                healthy_at = time.monotonic()
        assert healthy_at is not None and healthy_at - killed_at < 10

        # Sharing resumes: a new prefix is published to the new directory and imported.
        prompt = [rng.randrange(100, 40000) for _ in range(600)]
        deadline = time.monotonic() + 60
        while True:
            cold = _complete(serve_instance, prompt)
            try:
                _wait_published(min_entries=37, timeout_s=5)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "nothing published after the directory died"
        hits = _remote_hits(serve_instance)
        warm = _on_other_replica(serve_instance, prompt, cold.headers["x-engine-replica"])
        assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
        deadline = time.monotonic() + 10
        while _remote_hits(serve_instance) <= hits:
            assert time.monotonic() < deadline, "no remote hit counted after recovery"
            time.sleep(0.5)
    finally:
        undeploy(APP)


def test_rolling_update_to_another_dtype_never_imports_old_kv(
    serve_instance, tiny_llama_with_tokenizer, smollm2_tokenizer
):
    """A live app redeployed from float32 to bfloat16 under the same model name and hash key:
    the bf16 replicas never take the fp32 replicas' published blocks, whether the sender hashed
    the prompt under the new namespace or still under the old one (a sender that has not yet
    seen the redeploy), which the replica counts and rehashes."""
    from deployments.engine_request import EngineRequest, StreamItem
    from engine import LLM, SamplingParams
    from engine.block_hash import compute_block_hashes, hash_key, hash_root

    key = "a-fixed-key-for-both-deploys"
    args = {**_args(tiny_llama_with_tokenizer), "kv_hash_key": key}
    # One replica is enough: the new one finds the old one's blocks in the directory or not.
    deploy(serve_instance, args, name=APP, num_replicas=1)
    try:
        rng = random.Random(9)
        prompts = [[rng.randrange(100, 40000) for _ in range(600)] for _ in range(2)]
        for prompt in prompts:
            _complete(serve_instance, prompt)
        _wait_published(min_entries=2 * 37)
        handle = serve.get_deployment_handle("Engine", APP)
        before = handle.kv_namespace.remote().result()
        assert "dtype=float32" in before

        args["engine"] = {**args["engine"], "dtype": "bfloat16"}
        deploy(serve_instance, args, name=APP, num_replicas=1)
        # Another namespace: no block hash of the new replica can name an old block.
        handle = serve.get_deployment_handle("Engine", APP)
        after_ns = handle.kv_namespace.remote().result()
        assert after_ns != before and "dtype=bfloat16" in after_ns
        sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = LLM(
            model=str(tiny_llama_with_tokenizer), dtype="bfloat16", num_kv_blocks=64
        ).generate(prompts, sampling)
        after = _complete(serve_instance, prompts[0])
        assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert after.json()["choices"][0]["text"] == expected[0].text

        # The second prompt as a sender still on the old namespace would send it: the fp32
        # replica's hashes, which name the blocks it published.
        mismatches = total(metrics(serve_instance), "prefixserve_kv_namespace_mismatch_total")
        stale = EngineRequest(
            request_id="stale-sender",
            prompt_token_ids=prompts[1],
            sampling=sampling,
            block_hashes=compute_block_hashes(prompts[1], 16, hash_root(before, hash_key(key))),
            kv_namespace=before,
        )
        items = list(handle.options(stream=True).generate.remote(stale))
        assert all(isinstance(i, StreamItem) for i in items), items
        assert items[-1].done and items[-1].cached_tokens == 0
        assert "".join(i.text for i in items) == expected[1].text
        deadline = time.monotonic() + 10
        while (
            total(metrics(serve_instance), "prefixserve_kv_namespace_mismatch_total") <= mismatches
        ):
            assert time.monotonic() < deadline, "the stale namespace was not counted"
            time.sleep(0.5)
        # Nothing runs and no KV block is held any more: none leaked on the new replica.
        assert not any(wait_until_idle(serve_instance).values())
    finally:
        undeploy(APP)
