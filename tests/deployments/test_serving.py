"""The OpenAI-compatible service end to end: real Ray Serve, real HTTP, the official client."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.deployments.conftest import deploy, undeploy

pytestmark = pytest.mark.ray

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path) -> Iterator[str]:
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {
                "dtype": "float32",
                "num_kv_blocks": 256,
                "max_num_seqs": 16,
                "scheduling_policy": "deadline",
                "reject_late_requests": True,
            },
            "stream_interval_ms": 5,
        },
    )
    yield serve_instance
    undeploy()


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def streamed_completion(base_url: str, prompt: object, max_tokens: int) -> list[dict]:
    """A raw streamed greedy completion with usage: its chunks, after checking the SSE framing."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers.get("x-engine-replica")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_models_health_and_unknown_route(base_url: str, client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = httpx.get(f"{base_url}/v1/nope")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_streamed_equals_non_streamed(client: OpenAI) -> None:
    kwargs = dict(
        model="tiny",
        messages=QUESTION,
        max_tokens=24,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and not usage_chunks[0].choices
    assert usage_chunks[0].usage.completion_tokens == 24
    # The same prompt again: its full blocks now come from a prefix cache.
    assert usage_chunks[0].usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_raw_sse_and_token_prompt(base_url: str, client: OpenAI) -> None:
    chunks = streamed_completion(base_url, [5, 17, 300, 42, 9, 1000], 12)
    assert chunks[-1]["usage"]["prompt_tokens"] == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    full = client.completions.create(
        model="tiny",
        prompt=[5, 17, 300, 42, 9, 1000],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].text == streamed


def test_shared_prefix_reports_cached_tokens(client: OpenAI) -> None:
    prefix = list(range(100, 164))  # four full blocks of 16
    seen = []
    for suffix in ([7, 8, 9], [10, 11], [12]):
        r = client.completions.create(
            model="tiny", prompt=prefix + suffix, max_tokens=2, temperature=0
        )
        seen.append(r.usage.prompt_tokens_details.cached_tokens)
    # With two replicas, at least one of the later requests lands where the prefix is cached.
    assert seen[0] == 0
    assert max(seen[1:]) == 64


def test_cache_salt_shares_cached_tokens_only_within_a_salt(client: OpenAI) -> None:
    prompt = list(range(300, 364)) + [5]  # four full blocks of 16

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    # Routed by the salted hashes to the replica that holds them.
    assert max(cached("tenant-a"), cached("tenant-a")) == 64
    assert cached("tenant-b") == 0
    assert cached(None) == 0


def test_logprobs(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # Greedy picks the most likely token.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_aborts_and_frees_blocks(base_url: str, n: int) -> None:
    before = metrics(base_url)
    body = {
        "model": "tiny",
        "prompt": "Tell me a long story.",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "n": n,
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break
    # The connection is closed mid-stream; the engine must abort and release every block.
    deadline = time.monotonic() + 30
    while True:
        m = metrics(base_url)
        aborted = total(m, "prefixserve_requests_total", finish_reason="abort") - total(
            before, "prefixserve_requests_total", finish_reason="abort"
        )
        running = total(m, "prefixserve_num_requests_running")
        usage = total(m, "prefixserve_kv_cache_usage_ratio")
        if aborted >= n and running == 0 and usage == 0:
            break
        assert time.monotonic() < deadline, (
            f"not aborted: aborted={aborted} running={running} usage={usage}"
        )
        time.sleep(0.5)
    assert total(m, "prefixserve_kv_cache_free_blocks") == total(m, "prefixserve_kv_cache_blocks")


INVALID = [
    ("chat", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("chat", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat", {"model": "other", "messages": QUESTION}, 400, "model"),
    ("chat", {"model": "tiny", "messages": QUESTION, "n": 0}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": "hi", "n": 17}, 400, "n"),
    (
        "chat",
        {"model": "tiny", "messages": QUESTION, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("chat", {"model": "tiny", "messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    # The prompt alone overflows the context (1,024); one that fits asks for too many tokens.
    ("completions", {"model": "tiny", "prompt": list(range(3, 1100))}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5] * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", ["not", "an", "object"], 400, None),
    ("completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 150}}, 400, "logit_bias"),
    (
        "chat",
        {"model": "tiny", "messages": QUESTION, "logit_bias": {"49152": 1}},
        400,
        "logit_bias",
    ),
    (
        "chat",
        {"model": "tiny", "messages": QUESTION, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    (
        "completions",
        {"model": "tiny", "prompt": "hi", "frequency_penalty": -9},
        400,
        "frequency_penalty",
    ),
    (
        "completions",
        {"model": "tiny", "prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("completions", {"model": "tiny", "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("completions", {"model": "tiny", "prompt": ["hi"] * 65}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("chat", {"model": "tiny", "messages": QUESTION, "stop": ["x"] * 65}, 400, "stop"),
    ("completions", {"model": "tiny", "prompt": ["hi"] * 3, "n": 16}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": ["hi", ""]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [[5, 6], [7, 10**9]]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("completions", {"model": "tiny", "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("chat", {"model": "tiny", "messages": QUESTION, "cache_salt": 5}, 400, "cache_salt"),
    (
        "completions",
        {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 21},
        400,
        "logprobs",
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), INVALID)
def test_invalid_requests_get_openai_errors(base_url, endpoint, body, status, param) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(f"{base_url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_n_choices_streamed_and_not(client: OpenAI) -> None:
    """n choices come back with indexes 0..n-1; seeded choices are reproducible (choice 0 is
    the n=1 answer, the others differ), streamed or not; usage counts the prompt once."""
    kwargs = dict(
        model="tiny",
        messages=QUESTION,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert len(set(texts)) > 1, texts
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 3 * 8
    single = client.chat.completions.create(**kwargs)
    assert single.choices[0].message.content == texts[0]
    assert full.usage.prompt_tokens == single.usage.prompt_tokens

    chunks = list(
        client.chat.completions.create(
            **kwargs, n=3, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = ["", "", ""]
    finishes = [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == texts
    assert finishes == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 3 * 8

    completion = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0.0, n=2
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text  # greedy: the same


def test_penalties_and_logit_bias_reach_the_sampler(client: OpenAI) -> None:
    """The official client's fields: a +100 bias makes greedy decoding repeat one token; a
    frequency penalty then stops it repeating, so both were applied, per request."""
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0.0)
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    favourite = 1000
    biased = client.completions.create(
        **kwargs, logit_bias={str(favourite): 100}, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert biased.choices[0].logprobs.tokens == [biased.choices[0].logprobs.tokens[0]] * 6
    assert biased.choices[0].text != plain.choices[0].text
    penalized = client.completions.create(
        **kwargs,
        logit_bias={str(favourite): 100},
        frequency_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 100.0},
        logprobs=0,
    )
    tokens = penalized.choices[0].logprobs.tokens
    assert tokens[0] == biased.choices[0].logprobs.tokens[0]
    assert len(set(tokens)) > 1, tokens
    again = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert again.choices[0].text == plain.choices[0].text


def test_several_prompts_streamed_and_not(base_url: str, client: OpenAI) -> None:
    """A list of prompts: prompt i's choice k is choice i * n + k, each prompt's greedy text is
    what it gets alone, and usage counts every prompt once."""
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    kwargs = dict(model="tiny", max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in (0, 1)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 5

    chunks = streamed_completion(base_url, prompts, 5)
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [a.choices[0].text for a in alone]
    assert chunks[-1]["usage"]["prompt_tokens"] == batch.usage.prompt_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * 5


def test_echo_scores_prompts_as_transformers_does(
    client: OpenAI, tiny_llama_with_tokenizer: Path, smollm2_tokenizer
) -> None:
    """What lm-eval's loglikelihood asks: ``echo`` with ``max_tokens: 0`` and ``logprobs``, for
    several token-id prompts at once; each prompt token's logprob as transformers computes it."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 300], [5, 17, 300, 42, 9, 1000, 77, 4000, 123]]
    scored = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    assert [c.finish_reason for c in scored.choices] == ["length", "length"]
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == 3 + 9
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_with_tokenizer, dtype=torch.float32)
    for prompt, choice in zip(prompts, scored.choices, strict=True):
        assert choice.text == smollm2_tokenizer.decode(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        expected = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        for i in range(1, len(prompt)):
            best = ref[i - 1].topk(2)
            assert sorted(lp.top_logprobs[i].values()) == pytest.approx(
                sorted(best.values.tolist()), abs=1e-4
            )

    # Echo while generating, streamed: the prompt comes first, then the completion.
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=3,
            temperature=0,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chunks[0].choices[0].text.startswith("Once upon a time")
    assert text == "Once upon a time" + plain.choices[0].text


def test_malformed_json_and_still_serving(base_url: str, client: OpenAI) -> None:
    r = httpx.post(
        f"{base_url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    ok = client.completions.create(model="tiny", prompt="still alive?", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_vllm_metrics_and_dashboard_queries_resolve_and_move(base_url: str) -> None:
    """Every vLLM-named metric docs/metrics.md lists, and every sample the shipped dashboard
    queries, is on /metrics with the served model's name; under a little load the gauges rise
    and every counter and histogram advances."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.deploy.observability import (
        dashboard_queries,
        documented_types,
        load_dashboard,
        queried_samples,
    )

    def names(m: dict[tuple[str, tuple], float]) -> set[str]:
        return {n for n, _ in m}

    def exposition_names(doc_name: str, kind: str) -> str:
        return f"{doc_name}_count" if kind == "histogram" else doc_name

    types = documented_types()
    before = metrics(base_url)
    for name, kind in types.items():
        sample = exposition_names(name, kind)
        assert sample in names(before), sample
        assert {dict(lab).get("model_name") for n, lab in before if n == sample} == {"tiny"}
    queried = set().union(*(queried_samples(q) for q in dashboard_queries(load_dashboard())))
    assert queried and queried - names(before) == set()

    prefix = list(range(2000, 2064))  # four full blocks: the repeats hit the prefix cache
    # Long enough (seconds) that a report of every replica (each second) sees them running.
    body = {"model": "tiny", "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    httpx.post(f"{base_url}/v1/completions", json={**body, "prompt": prefix}, timeout=60)

    def stream(k: int) -> None:
        payload = {**body, "prompt": prefix + [k + 3], "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=payload, timeout=60) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    peak = {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, k) for k in range(6)]
        while not all(f.done() for f in futures):
            during = metrics(base_url)
            for name in peak:
                peak[name] = max(peak[name], total(during, name))
        for f in futures:
            f.result()
    assert all(v > 0 for v in peak.values()), peak

    advancing = [
        exposition_names(n, kind) for n, kind in types.items() if kind in ("counter", "histogram")
    ]
    # Nothing imports KV (one machine), preempts (a roomy cache) or stops at EOS (ignore_eos).
    idle = {"vllm:external_prefix_cache_hits_total", "vllm:num_preemptions_total"}

    def gained(after: dict, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    def settled(after: dict) -> bool:
        # Another replica's figures may lag a report period (1 s); an earlier test's last
        # request may land in the interval too, hence at least, not exactly.
        return (
            {n for n in advancing if gained(after, n) > 0} >= set(advancing) - idle
            and gained(after, "vllm:request_success_total", finished_reason="length") >= 7
            and gained(after, "vllm:generation_tokens_total") >= 7 * 256
        )

    deadline = time.monotonic() + 20
    after = metrics(base_url)
    while not settled(after) and time.monotonic() < deadline:
        time.sleep(0.5)
        after = metrics(base_url)
    assert {n for n in advancing if gained(after, n) <= 0} <= idle
    assert gained(after, "vllm:request_success_total", finished_reason="length") >= 7
    assert gained(after, "vllm:generation_tokens_total") >= 7 * 256


def test_vllm_metrics_reach_rays_metrics_pipeline(base_url: str) -> None:
    """The same families under Ray's names on every node's metrics agent (what Ray's own
    dashboards and a Prometheus scraping Ray read), once requests have been served."""
    import ray

    from tests.deploy.observability import documented_types

    # A shared prefix of four blocks: the repeats record prefix cache hits as well.
    for suffix in ([7], [8], [9]):
        body = {"model": "tiny", "prompt": list(range(3000, 3064)) + suffix, "max_tokens": 4}
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]

    def exported() -> dict[tuple[str, tuple], float]:
        out: dict[tuple[str, tuple], float] = {}
        for port in ports:
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                for fam in text_string_to_metric_families(text):
                    for s in fam.samples:
                        key = (s.name, tuple(sorted(s.labels.items())))
                        out[key] = out.get(key, 0.0) + s.value
        return out

    # Ray exports a series once something was recorded in it: not these two here (no KV import,
    # no preemption), which /metrics shows at 0.
    never_recorded = {"vllm:external_prefix_cache_hits_total", "vllm:num_preemptions_total"}
    expected = {
        "ray_" + name.replace(":", "_") + ("_count" if kind == "histogram" else "")
        for name, kind in documented_types().items()
        if name not in never_recorded
    }
    # Ray's agents export what replicas record every few seconds (Ray's report interval), and
    # one family may reach an agent a report later than another.
    deadline = time.monotonic() + 60
    while True:
        m = exported()
        missing = expected - {n for n, _ in m}
        if not missing and all(
            total(m, f"ray_vllm_{name}", model_name="tiny") > 0
            for name in (
                "generation_tokens_total",
                "prefix_cache_hits_total",
                "e2e_request_latency_seconds_count",
            )
        ):
            break
        assert time.monotonic() < deadline, (
            sorted(missing),
            sorted({n for n, _ in m if "vllm" in n}),
        )
        time.sleep(2)


def test_replicas_warm_up_and_late_requests_get_a_429(base_url: str, client: OpenAI) -> None:
    # deploy() waited for /health: every replica had finished its warm-up by then.
    warmups = {
        lab: v
        for (name, lab), v in metrics(base_url).items()
        if name == "prefixserve_engine_warmup_seconds"
    }
    assert len(warmups) == 2 and all(v > 0 for v in warmups.values())
    # A deadline of 1 µs has passed before the engine's next step: rejected before any work.
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(
            model="tiny", prompt="Hello", max_tokens=4, extra_body={"deadline_ms": 0.001}
        )
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "deadline_exceeded"
    assert "deadline_ms" in error["message"]
    body = {
        "model": "tiny",
        "messages": QUESTION,
        "max_tokens": 4,
        "stream": True,
        "deadline_ms": 0.001,
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_exceeded"
    assert r.headers.get("retry-after")
    # A deadline that can be met, with vLLM's priority: served as usual.
    out = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=3,
        extra_body={"deadline_ms": 60_000, "priority": -1},
    )
    assert out.choices[0].finish_reason == "length"
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        m = metrics(base_url)
        if total(m, "prefixserve_requests_deadline_missed_total", action="rejected") >= 2:
            break
        time.sleep(0.5)
    assert total(m, "prefixserve_requests_deadline_missed_total", action="rejected") == 2
    assert total(m, "prefixserve_requests_total", finish_reason="rejected") == 2
    assert total(m, "prefixserve_kv_admission_watermark_blocks") > 0
