"""Tenants without a cluster: cache_salt in the request schema and the block hashes routing uses,
and the option that leaves cache-hit signals out of responses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import AppArgs
from deployments.engine_request import StreamItem
from deployments.generation import Generation
from deployments.openai_format import ResponseBuilder, usage
from deployments.protocol import MAX_CACHE_SALT_CHARS, CompletionRequest
from deployments.validation import GenerationJob
from engine.block_hash import compute_block_hashes, hash_root
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_cache_salt_is_bounded_in_the_schema() -> None:
    assert CompletionRequest(prompt="hi", cache_salt="tenant-1").cache_salt == "tenant-1"
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 7):
        with pytest.raises(ValidationError) as e:
            CompletionRequest(prompt="hi", cache_salt=bad)
        assert e.value.errors()[0]["loc"] == ("cache_salt",)


def test_salted_hashes_differ_per_salt() -> None:
    ids = list(range(64))
    plain = compute_block_hashes(ids, 16, hash_root("ns"))
    a = compute_block_hashes(ids, 16, hash_root("ns", cache_salt="a"))
    b = compute_block_hashes(ids, 16, hash_root("ns", cache_salt="b"))
    assert a == compute_block_hashes(ids, 16, hash_root("ns", cache_salt="a"))
    # Not one block in common: a salt changes the root of the chain.
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)


def last(cached: int) -> StreamItem:
    return StreamItem(
        replica_id="replica-1",
        index=0,
        token_ids=[1],
        text="x",
        finished=True,
        done=True,
        finish_reason="length",
        stop_reason=None,
        prompt_tokens=20,
        completion_tokens=1,
        cached_tokens=cached,
    )


@pytest.mark.parametrize("report", [True, False])
def test_usage_reports_cached_tokens_only_when_allowed(report: bool) -> None:
    body = usage([last(16)], report_cached=report)
    assert body["prompt_tokens"] == 20 and body["total_tokens"] == 21
    assert ("prompt_tokens_details" in body) is report
    if report:
        assert body["prompt_tokens_details"] == {"cached_tokens": 16}
    full = ResponseBuilder("completion", "id", "tiny", None, report_cached=report).full([last(16)])
    assert ("prompt_tokens_details" in full["usage"]) is report


@pytest.mark.parametrize("report", [True, False])
def test_the_replica_header_only_when_allowed(report: bool) -> None:
    generation = Generation(AppArgs(report_cache_hits=report), backend=None, admission=None)  # type: ignore[arg-type]
    headers = generation._replica_header([last(0)])
    assert headers == ({"x-engine-replica": "replica-1"} if report else {})


def test_engine_requests_carry_the_salt_and_hashes_routing_can_match(tiny_llama) -> None:
    """The HTTP side's hashes (what the router and KV sharing key by) are the engine's, under
    the namespace the engine reports and the application's key."""
    args = AppArgs(model=str(tiny_llama), kv_hash_key="k" * 32)
    engine = LLMEngine(args.engine_config().replace(num_kv_blocks=16, dtype="float32"))
    generation = Generation(args, backend=None, admission=None)  # type: ignore[arg-type]
    ids = list(range(40))
    job = GenerationJob(
        prompts=[ids],
        params=SamplingParams(),
        builder=ResponseBuilder("completion", "id", "m", None),
        n=1,
        stream=False,
        include_usage=False,
        priority=0,
        cache_salt="t",
    )
    (req,) = generation.engine_requests(job, engine.kv_namespace)
    assert req.cache_salt == "t" and req.kv_namespace == engine.kv_namespace
    assert req.block_hashes == engine.make_request("r", ids, cache_salt="t").block_hashes
    assert req.block_hashes != engine.make_request("r", ids).block_hashes
    # Another key (another application) shares nothing.
    other = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, dtype="float32"))
    assert not set(req.block_hashes) & set(
        other.make_request("r", ids, cache_salt="t").block_hashes
    )
    # Until the namespace is known, prompts carry no hashes (routed by load, never wrongly).
    (unknown,) = generation.engine_requests(job, None)
    assert unknown.block_hashes == [] and unknown.kv_namespace is None
