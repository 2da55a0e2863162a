"""Hostile and random traffic against one deployment: the API key, the limits, a fuzz of the
HTTP API, and a soak with random client disconnects. Afterwards nothing may be left running and
every KV block must be free (or held only by the prefix cache, which counts as free).

The deployment is small on purpose: few KV blocks (so requests get preempted), short outputs,
KV sharing on, and an API key on every route but /ping.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.deployments.conftest import deploy, undeploy
from tests.deployments.fuzz_strategies import GEN_PATHS, MAX_BODY, MAX_TOKENS, fuzz_request
from tests.deployments.support import scrape, sse_payloads, total, wait_until_idle

pytestmark = pytest.mark.ray

API_KEY = "fuzz-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_PROMPT_TOKENS = 192
FUZZ_BATCHES = 130  # x 8 requests each
SOAK_REQUESTS = 2000
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def base_url(serve_instance: str, tiny_llama_with_tokenizer: Path) -> Iterator[str]:
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "api_key": API_KEY,
            "engine": {"dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 8},
            "kv_sharing": {"min_blocks": 2},
            "limits": {
                "max_body_bytes": MAX_BODY,
                "max_prompt_tokens": MAX_PROMPT_TOKENS,
                "max_tokens": MAX_TOKENS,
                "max_waiting_per_replica": 8,
                "max_ongoing_per_ingress": 48,
                "request_timeout_s": 60,
            },
            "stream_interval_ms": 5,
        },
    )
    yield serve_instance
    undeploy()


# -- the API key ---------------------------------------------------------------------------------

GUARDED = [
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]


@pytest.mark.parametrize("header", [None, "Bearer wrong", API_KEY, f"Basic {API_KEY}", "Bearer"])
@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_api_key_guards_every_route(base_url: str, method: str, path: str, header: str) -> None:
    headers = {} if header is None else {"Authorization": header}
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.request(method, f"{base_url}{path}", headers=headers, json=body, timeout=30)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


def test_ping_stays_open_and_the_key_opens_the_rest(base_url: str) -> None:
    ping = httpx.get(f"{base_url}/ping", timeout=30)
    assert ping.status_code == 200 and ping.json() == {"status": "alive"}
    health = httpx.get(f"{base_url}/health", headers=AUTH, timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=30).status_code == 200
    # The scheme is case-insensitive (RFC 9110).
    lower = {"Authorization": f"bearer {API_KEY}"}
    assert httpx.get(f"{base_url}/v1/models", headers=lower, timeout=30).status_code == 200
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- the limits ----------------------------------------------------------------------------------


def test_body_size_limit_with_and_without_content_length(base_url: str) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY + 10)}).encode()
    url = f"{base_url}/v1/completions"
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(url, content=big, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = httpx.post(url, content=chunks(), headers=headers, timeout=30)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_prompt_and_output_token_limits(base_url: str) -> None:
    url = f"{base_url}/v1/completions"
    long_prompt = {"model": "tiny", "prompt": list(range(5, 6 + MAX_PROMPT_TOKENS))}
    r = httpx.post(url, json=long_prompt, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_TOKENS + 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": MAX_TOKENS + 1}),
    ]:  # fmt: skip
        r = httpx.post(f"{base_url}{path}", json={"model": "tiny", **body}, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("max_tokens", "max_completion_tokens")
    # At the limit it works, and chat's default output length is capped by it.
    ok = httpx.post(url, json={**long_prompt, "prompt": long_prompt["prompt"][:-1]}, headers=AUTH)
    assert ok.status_code == 200, ok.text
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        headers=AUTH,
        timeout=30,
    )
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == MAX_TOKENS


# -- fuzz ----------------------------------------------------------------------------------------


def send(client: httpx.Client, request: tuple) -> tuple[int, str]:
    """Send one fuzzed request; return its status and a description of anything wrong."""
    kind, method, path, payload, extra = request
    headers = dict(AUTH)
    content: Any = None
    if kind == "json":
        headers["Content-Type"] = extra
        content = json.dumps(payload, allow_nan=True).encode()
    elif kind == "raw":
        headers["Content-Type"] = extra
        content = payload
    elif kind == "huge":
        body = b'{"prompt": "' + b"y" * payload + b'"}'
        chunked = extra
        content = (body[i : i + 8192] for i in range(0, len(body), 8192)) if chunked else body
        headers["Content-Type"] = "application/json"
    streamed = kind == "json" and isinstance(payload, dict) and payload.get("stream") is True
    with client.stream(method, path, content=content, headers=headers) as r:
        # Split on "\n" only: iter_lines also splits on U+0085 and U+2028, which JSON strings
        # (an echoed prompt, generated text) may hold unescaped.
        lines = r.read().decode().split("\n")
        status = r.status_code
        ctype = r.headers.get("content-type", "")
    problem = ""
    if status >= 500:
        problem = f"{status}"
    elif status == 200 and ctype.startswith("text/event-stream"):
        problem = check_sse(lines)
    elif status == 200 and path in GEN_PATHS:
        problem = check_completion(json.loads("\n".join(lines)))
    elif status != 200:
        body = json.loads("\n".join(lines))
        if set(body.get("error", {})) != ERROR_KEYS:
            problem = f"error body {body}"
    if kind == "huge" and status != 413:
        problem = f"huge body answered {status}"
    if status == 200 and streamed and not ctype.startswith("text/event-stream"):
        problem = "stream requested, none returned"
    return status, problem and f"{problem} for {kind} {method} {path} {str(payload)[:200]}"


def check_completion(body: dict[str, Any]) -> str:
    """Every choice (several prompts times n) finished, indexed 0..k-1; usage within bounds
    (an echo of the prompt alone, ``max_tokens: 0``, generates nothing)."""
    choices = body["choices"]
    if [c["index"] for c in choices] != list(range(len(choices))) or not choices:
        return f"choice indexes {[c['index'] for c in choices]}"
    if any(c["finish_reason"] not in ("stop", "length") for c in choices):
        return f"finish reasons {[c['finish_reason'] for c in choices]}"
    if not 0 <= body["usage"]["completion_tokens"] <= MAX_TOKENS * len(choices):
        return f"usage {body['usage']}"
    return ""


def check_sse(lines: list[str]) -> str:
    """[DONE] at the end, no error event, and each choice finished exactly once."""
    events = sse_payloads(lines)
    if not events or events[-1] != "[DONE]":
        return "stream without [DONE]"
    if any("error" in e for e in events[:-1]):
        return f"error event {events}"
    finished = sorted(
        (c["index"], c["finish_reason"])
        for e in events[:-1]
        for c in e["choices"]
        if c["finish_reason"]
    )
    indexes = [i for i, _ in finished]
    reasons = {r for _, r in finished}
    if indexes != list(range(len(indexes))) or not indexes or not reasons <= {"stop", "length"}:
        return f"finish reasons {finished}"
    return ""


def test_fuzz_http_api(base_url: str) -> None:
    statuses: Counter[int] = Counter()
    problems: list[str] = []
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    with (
        httpx.Client(base_url=base_url, timeout=60, limits=limits) as client,
        ThreadPoolExecutor(8) as pool,
    ):

        @settings(
            max_examples=FUZZ_BATCHES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(batch=st.lists(fuzz_request, min_size=8, max_size=8))
        def run_batch(batch: list[tuple]) -> None:
            for status, problem in pool.map(lambda req: send(client, req), batch):
                statuses[status] += 1
                if problem:
                    problems.append(problem)
            assert not problems, problems[:5]

        run_batch()
        sent = sum(statuses.values())
        # Still serving, with the same answers.
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "ok?"}, headers=AUTH)
        assert r.status_code == 200, r.text
    print(f"\nfuzz: {sent} requests, statuses {dict(sorted(statuses.items()))}")
    assert sent >= 1000
    assert not any(s >= 500 for s in statuses)
    assert statuses[200] >= 250  # the valid requests do get served
    state = wait_until_idle(base_url, AUTH)
    assert not any(state.values()), state


# -- soak ----------------------------------------------------------------------------------------

WORDS = ["alpha", "beta", "gamma", "delta", "tree", "river", "stone", "cloud", "fire", "sea"]


def soak_request(rng: random.Random, prefixes: list[list[int]]) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.4
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": rng.randint(1, MAX_TOKENS),
        "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(WORDS)
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        return "/v1/chat/completions", body
    if rng.random() < 0.4:
        body["prompt"] = rng.choice(prefixes) + [rng.randrange(3, 49000) for _ in range(5)]
    elif rng.random() < 0.5:
        body["prompt"] = [rng.randrange(3, 49000) for _ in range(rng.randint(1, 180))]
    else:
        body["prompt"] = "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 300)))
    if rng.random() < 0.15:
        # Several prompts: one engine request each, possibly on different replicas.
        body["prompt"] = [
            rng.choice(prefixes) + [rng.randrange(3, 49000) for _ in range(5)]
            for _ in range(rng.randint(2, 3))
        ]
    if rng.random() < 0.05:
        body["max_tokens"] = 0  # invalid without echo: a 400 in the mix
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        body["echo"] = True  # with logprobs: the whole prompt computed and scored
    return "/v1/completions", body


async def soak_one(
    client: httpx.AsyncClient, rng: random.Random, prefixes: list[list[int]], tally: Counter
) -> None:
    path, body = soak_request(rng, prefixes)
    disconnect = rng.random() < 0.3
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body, headers=AUTH) as r:
                tally[f"status {r.status_code}"] += 1
                if r.status_code != 200:
                    await r.aread()
                    return
                lines = []
                keep = rng.randint(0, 3) if disconnect else None
                async for line in r.aiter_lines():
                    lines.append(line)
                    if keep is not None and sum(x.startswith("data:") for x in lines) > keep:
                        tally["disconnected mid-stream"] += 1
                        return  # leaving the block closes the connection
                problem = check_sse(lines)
                if problem:
                    tally["errors"] += 1
                    tally[problem[:80]] += 1
        else:
            if disconnect:
                try:
                    await asyncio.wait_for(
                        client.post(path, json=body, headers=AUTH), rng.uniform(0.005, 0.2)
                    )
                    tally["status 200 before the client gave up"] += 1
                except TimeoutError:
                    tally["gave up waiting"] += 1
                return
            r = await client.post(path, json=body, headers=AUTH)
            tally[f"status {r.status_code}"] += 1
            if r.status_code == 200:
                problem = check_completion(r.json())
                if problem:
                    tally["errors"] += 1
                    tally[problem[:80]] += 1
            elif r.status_code >= 500:
                tally["errors"] += 1
    except httpx.HTTPError as e:
        tally["errors"] += 1
        tally[f"client error {type(e).__name__}"] += 1


def test_soak_with_random_disconnects(base_url: str) -> None:
    rng = random.Random(2024)
    prefixes = [[rng.randrange(3, 49000) for _ in range(48)] for _ in range(4)]
    before = scrape(base_url, AUTH)
    tally: Counter[str] = Counter()

    async def run() -> None:
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(SOAK_REQUESTS):
                queue.put_nowait(i)

            async def worker(seed: int) -> None:
                wrng = random.Random(seed)
                while not queue.empty():
                    queue.get_nowait()
                    tally["tried"] += 1
                    await soak_one(client, wrng, prefixes, tally)

            await asyncio.gather(*(worker(rng.randrange(2**32)) for _ in range(16)))

    asyncio.run(run())
    state = wait_until_idle(base_url, AUTH, timeout_s=60)
    after = scrape(base_url, AUTH)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    aborted = delta("prefixserve_requests_total", finish_reason="abort")
    faults = tally["disconnected mid-stream"] + tally["gave up waiting"]
    print(
        f"\nsoak: {tally['tried']} requests tried, {faults} client disconnects injected "
        f"({tally['disconnected mid-stream']} mid-stream, {tally['gave up waiting']} while "
        f"waiting), {aborted:.0f} aborted by the engine, "
        f"{delta('prefixserve_num_preemptions_total'):.0f} preemptions, "
        f"{delta('prefixserve_prefix_cache_hit_tokens_total', source='remote'):.0f} prompt tokens "
        f"from another replica's KV, {tally['errors']} errors, "
        f"{state['blocks_leaked']:.0f} blocks leaked; idle state {state}; tally {dict(tally)}"
    )
    assert tally["tried"] == SOAK_REQUESTS
    assert tally["errors"] == 0, tally
    assert faults >= SOAK_REQUESTS // 10
    assert aborted >= 1
    assert not any(state.values()), state
    assert total(after, "prefixserve_kv_cache_free_blocks") == total(
        after, "prefixserve_kv_cache_blocks"
    )
