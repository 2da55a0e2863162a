"""Ray Serve's own ``PrefixCacheAffinityRouter`` on our Engine deployment (``routing_policy:
ray_prefix_affinity``): its configuration, and that it finds the prompt's text on the request
object our ingress sends, through Ray's own extraction code (a Ray release that reads requests
differently fails here, not silently in a benchmark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)

from deployments.admission import Admission
from deployments.config import AppArgs
from deployments.engine_backend import prompt_text
from deployments.engine_request import EngineRequest
from deployments.generation import Generation
from deployments.request_router_config import request_router_config
from deployments.validation import RequestValidator
from tests.router.test_request_router import build_router, pending, run


def test_the_policy_plugs_rays_router_with_its_kwargs() -> None:
    config = request_router_config(
        "ray_prefix_affinity", {}, 0.5, ray_args={"match_rate_threshold": 0.2}
    )
    assert config.get_request_router_class() is PrefixCacheAffinityRouter
    # Unset fields keep Ray's defaults (an infinite imbalance threshold).
    assert config.request_router_kwargs == {"match_rate_threshold": 0.2}
    assert config.request_routing_stats_period_s == 0.5
    with pytest.raises(ValidationError, match="match_rate_threshold"):
        request_router_config("ray_prefix_affinity", {}, ray_args={"match_rate_threshold": 2})


def test_config_names_the_field_of_a_bad_value() -> None:
    args = AppArgs.model_validate({"routing_policy": "ray_prefix_affinity", "layout": "routed"})
    assert args.ray_prefix_affinity.imbalanced_threshold is None
    with pytest.raises(ValidationError, match="routing_policy"):
        AppArgs.model_validate({"routing_policy": "ray_prefix"})
    # The direct layout's replica chooser never reports where a request went: Ray's tree would
    # stay empty.
    with pytest.raises(ValidationError, match="routing_policy: ray_prefix_affinity needs layout"):
        AppArgs.model_validate({"routing_policy": "ray_prefix_affinity", "layout": "direct"})
    with pytest.raises(ValidationError, match="imbalanced_threshold"):
        AppArgs.model_validate({"ray_prefix_affinity": {"imbalanced_threshold": -1}})
    with pytest.raises(ValidationError, match="eviction"):
        AppArgs.model_validate({"ray_prefix_affinity": {"eviction": True}})


def test_rays_router_reads_the_prompt_text_of_our_request() -> None:
    async def body() -> None:
        router = build_router(request_router_config("ray_prefix_affinity", {}))
        text = "<|im_start|>system\nYou are a cache.<|im_end|>\n"
        req = EngineRequest("r1", [1, 2, 3], block_hashes=[7], prompt=text)
        assert router._extract_text_from_request(pending(req)) == text
        # Without the text (our own policies' requests) Ray's router has nothing to match.
        with pytest.raises(ValueError, match="prompt"):
            router._extract_text_from_request(pending(EngineRequest("r2", [1, 2, 3])))

    run(body)


def test_prompt_text_is_never_empty(smollm2_tokenizer: Any) -> None:
    ids = list(smollm2_tokenizer.encode("Paris is the capital of France."))
    assert prompt_text(smollm2_tokenizer, ids) == smollm2_tokenizer.decode(ids)
    assert prompt_text(None, [5, 17]) == "5 17"
    assert prompt_text(smollm2_tokenizer, []) == " "


def test_engine_requests_carry_the_text_only_for_rays_router(
    tiny_llama_with_tokenizer: Path,
) -> None:
    base = {"model": str(tiny_llama_with_tokenizer), "served_model_name": "tiny"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}
    ours = AppArgs.model_validate(base)
    rays = AppArgs.model_validate({**base, "routing_policy": "ray_prefix_affinity"})
    validator = RequestValidator(rays)
    job = validator.chat(chat)
    (req,) = Generation(rays, backend=None, admission=Admission("t", 8)).engine_requests(job, None)  # type: ignore[arg-type]
    # The templated prompt, as the engine caches it: the template's markers included.
    assert req.prompt == validator.tokenizer.decode(job.prompts[0])
    assert "Hello there" in req.prompt and "<|im_start|>" in req.prompt
    (plain,) = Generation(ours, backend=None, admission=Admission("t", 8)).engine_requests(
        job, None
    )  # type: ignore[arg-type]
    assert plain.prompt is None
    assert plain.block_hashes == req.block_hashes
