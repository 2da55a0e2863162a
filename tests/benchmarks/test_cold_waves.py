"""benchmarks.cold_waves: the waves' prompts, one wave over real HTTP (a fake OpenAI server), and
the summary."""

from __future__ import annotations

import asyncio

import numpy as np

from benchmarks.cold_waves import SHAPES, Wave, WaveShape, run_wave, summarize, wave_requests
from benchmarks.workloads import DEFAULT_VOCAB_SIZE, safe_id_range
from tests.benchmarks.fake_openai_server import MODEL, FakeServer, RunningFakeServer


def test_prefix_waves_pair_prompts_on_fresh_prefixes() -> None:
    rng = np.random.default_rng(0)
    first, second = wave_requests(SHAPES["prefix"], rng), wave_requests(SHAPES["prefix"], rng)
    low, high = safe_id_range(DEFAULT_VOCAB_SIZE)
    for wave in (first, second):
        assert len(wave) == 8
        assert all(len(r.prompt_token_ids) == 544 and r.output_len == 32 for r in wave)
        assert all(low <= t < high for r in wave for t in r.prompt_token_ids)
        heads = [tuple(r.prompt_token_ids[:512]) for r in wave]
        assert len(set(heads)) == 4 and heads[:4] == heads[4:]  # prompt i on prefix i mod 4
        assert len({tuple(r.prompt_token_ids[512:]) for r in wave}) == 8
    # Nothing a second wave asks for was cached by the first.
    assert not {r.prompt_token_ids[0] for r in first} & {r.prompt_token_ids[0] for r in second}
    rand = wave_requests(SHAPES["random"], rng)
    assert len(rand) == 32 and all(r.shared_prefix_len == 0 for r in rand)
    assert all(len(r.prompt_token_ids) == 100 for r in rand)


def test_a_wave_over_http_and_the_summary() -> None:
    fake = FakeServer(first_token_delay=0.05)
    shape = WaveShape(prompts=4, prefixes=0, prefix_len=0, suffix_len=8, output_len=3)
    with RunningFakeServer(fake):
        reqs = wave_requests(shape, np.random.default_rng(1))
        wave = asyncio.run(run_wave(fake.base_url, MODEL, reqs, "ours", 0))
    # The fake answers its 4 first requests (n = 0-3) with full streams.
    assert wave.errors == []
    assert len(wave.ttfts_ms) == 4 and all(t >= 50 for t in wave.ttfts_ms)
    # Sent at once: they reach the server in any order.
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(r.prompt_token_ids for r in reqs)
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 3 for b in fake.bodies)

    waves = [
        Wave("ours", 0, [100.0, 300.0, 200.0]),
        Wave("vllm", 0, [150.0, 150.0, 400.0]),
        Wave("vllm", 1, [], errors=["boom"]),
        Wave("ours", 1, [500.0, 100.0, 100.0]),
    ]
    s = summarize(waves)
    assert s["ours"] == {
        "waves": 2,
        "median_wave_max_ms": 400.0,  # maxima 300 and 500
        "median_wave_p50_ms": 150.0,  # medians 200 and 100
        "failed": 0,
    }
    assert s["vllm"]["waves"] == 1 and s["vllm"]["median_wave_max_ms"] == 400.0
    assert s["vllm"]["failed"] == 1
