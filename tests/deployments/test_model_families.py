"""The families beyond Llama through the server: real Ray Serve, real HTTP, the official client.
Greedy completions of a tiny Gemma 3 (sliding and global layers, local RoPE, q/k norms, Gemma's
norms) are transformers' tokens, through chunked prefill and prefix-cache hits."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.deployments.conftest import deploy, undeploy
from tests.helpers import hf_greedy, make_tiny_family

pytestmark = pytest.mark.ray

MAX_NEW = 16


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_family(tmp_path_factory.mktemp("gemma3-served"), "gemma3")


@pytest.fixture(scope="module")
def client(serve_instance: str, gemma3_dir: Path) -> Iterator[OpenAI]:
    deploy(
        serve_instance,
        {
            "model": str(gemma3_dir),
            "served_model_name": "tiny-gemma3",
            "engine": {
                "dtype": "float32",
                "block_size": 8,
                "num_kv_blocks": 256,
                "max_num_batched_tokens": 24,
            },
        },
        num_replicas=1,
    )
    yield OpenAI(base_url=f"{serve_instance}/v1", api_key="unused", max_retries=0)
    undeploy()


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    """The model has no tokenizer: the server names each token ``<id>``."""
    assert all(t.startswith("<") and t.endswith(">") for t in logprobs_tokens)
    return [int(t[1:-1]) for t in logprobs_tokens]


def test_gemma3_greedy_matches_transformers_through_the_server(
    client: OpenAI, gemma3_dir: Path
) -> None:
    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 30, 61)]
    reference = hf_greedy(gemma3_dir, prompts, MAX_NEW)
    body = {"min_tokens": MAX_NEW, "ignore_eos": True}
    # All prompts in one request, then each again: the second pass hits the cached prefix.
    batch = client.completions.create(
        model="tiny-gemma3",
        prompt=prompts,
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=1,
        extra_body=body,
    )
    assert [token_ids(c.logprobs.tokens) for c in batch.choices] == reference
    for prompt, expected in zip(prompts, reference, strict=True):
        chunks = list(
            client.completions.create(
                model="tiny-gemma3",
                prompt=prompt,
                max_tokens=MAX_NEW,
                temperature=0,
                logprobs=1,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=body,
            )
        )
        streamed = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
        assert token_ids(streamed) == expected
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 8 * 8
