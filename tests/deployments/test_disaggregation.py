"""Prefill/decode disaggregation end to end: one Prefill and one Engine (decode) replica.

Greedy text is checked against transformers' own greedy decoding of the same checkpoint, which
is also what the colocated layout serves (test_serving.py, test_kv_sharing.py), so the two modes
give the same text; the handoff is checked to have gone through the object store (the decode
replica counts remote prefix hits), and random client aborts leave no KV block held on either
side.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import deploy, undeploy
from tests.deployments.test_serving import metrics, total
from tests.helpers import hf_greedy

pytestmark = pytest.mark.ray

APP = "disagg"
MAX_TOKENS = 12


def _args(model: Path) -> dict:
    return {
        "model": str(model),
        "served_model_name": "tiny",
        # A small token budget: the long prompts are prefilled in chunks.
        "engine": {
            "dtype": "float32",
            "num_kv_blocks": 256,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
        },
        "kv_sharing": {"enabled": True, "min_blocks": 4},
        # An SLO every replica keeps: decode replicas are ranked through it, never missing it.
        "disaggregation": {"enabled": True, "tbt_slo_ms": 60000},
        "stream_interval_ms": 0,
    }


def _stream_text(base_url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-2:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" not in chunks[-1], chunks[-1]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def _by_role(m: dict, role: str) -> list[str]:
    return [
        dict(labels)["replica"]
        for (name, labels), v in m.items()
        if name == "prefixserve_replica_role" and dict(labels)["role"] == role and v == 1
    ]


def _abort_after(base_url: str, prompt: list[int], chunks: int) -> None:
    """Open a stream and drop the connection after ``chunks`` SSE events (0: at once)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if seen >= chunks:
                break
            seen += line.startswith("data: ")


def test_disaggregated_greedy_text_handoff_and_no_leaks(
    serve_instance, tiny_llama_with_tokenizer, smollm2_tokenizer
):
    # Health counts both deployments' replicas: 1 Prefill + 1 Engine.
    deploy(
        serve_instance,
        _args(tiny_llama_with_tokenizer),
        name=APP,
        layout="routed",
        num_replicas=2,
        engine_options={"num_replicas": 1},
    )
    try:
        rng = random.Random(11)
        # Four distinct prompts longer than the token budget, then the first again (a prefix
        # hit on the prefill side), all streamed at once.
        prompts = [
            [rng.randrange(100, 40000) for _ in range(rng.randrange(150, 300))] for _ in range(4)
        ]
        expected = [
            smollm2_tokenizer.decode(t, skip_special_tokens=True)
            for t in hf_greedy(tiny_llama_with_tokenizer, prompts, MAX_TOKENS)
        ]
        texts: list[str | None] = [None] * 4
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                texts[i] = _stream_text(serve_instance, prompts[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert texts == expected
        assert _stream_text(serve_instance, prompts[0]) == expected[0]

        # Every prompt went through a handoff, and the decode replica imported the prompts'
        # blocks from the object store (remote hits) rather than recomputing them.
        m = metrics(serve_instance)
        assert total(m, "prefixserve_handoffs_total", outcome="handed_off") == 5
        assert any(name == "prefixserve_tbt_slo_misses_total" for name, _ in m)
        assert total(m, "prefixserve_tbt_slo_misses_total") == 0
        assert total(m, "prefixserve_handoff_blocks_total") >= sum(len(p) // 16 for p in prompts)
        (decode,) = _by_role(m, "decode")
        (prefill,) = _by_role(m, "prefill")
        deadline = time.monotonic() + 10
        while True:
            remote = total(
                m, "prefixserve_prefix_cache_hit_tokens_total", source="remote", replica=decode
            )
            if remote >= 16 * sum(len(p) // 16 for p in prompts) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
            m = metrics(serve_instance)
        assert remote >= 16 * sum(len(p) // 16 for p in prompts)

        # Clients that go away at random points: during the prefill, at the handoff, while
        # decoding. Afterwards every block is free again on both sides.
        aborts = [
            threading.Thread(target=_abort_after, args=(serve_instance, prompts[i % 4], c))
            for i, c in enumerate(rng.choices(range(4), k=8))
        ]
        for t in aborts:
            t.start()
        for t in aborts:
            t.join()
        deadline = time.monotonic() + 20
        while True:
            m = metrics(serve_instance)
            free = {
                r: (
                    total(m, "prefixserve_kv_cache_free_blocks", replica=r),
                    total(m, "prefixserve_kv_cache_blocks", replica=r),
                )
                for r in (prefill, decode)
            }
            if all(f == n > 0 for f, n in free.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert all(f == n > 0 for f, n in free.values()), free
        # And both sides still serve.
        assert _stream_text(serve_instance, prompts[1]) == expected[1]
    finally:
        undeploy(APP)
