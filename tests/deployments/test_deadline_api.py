"""``deadline_ms`` and ``priority`` on the OpenAI routes, without a cluster: validated in the one
validation place (a 400 naming the field), carried to the engine request, a missed deadline
answered with a 429 that is not retried on another replica, and the scheduling metrics
exported per replica."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.admission import Admission
from deployments.config import AppArgs
from deployments.engine_request import DEADLINE_EXCEEDED, EngineError, EngineRequest
from deployments.generation import Generation
from deployments.http_errors import HTTPError, error_response
from deployments.metrics import ReplicaMetrics, render
from deployments.request_limits import MAX_DEADLINE_MS
from deployments.validation import RequestValidator
from engine.llm_engine import EngineStats


def make_validator(model: Path, policy: str = "fcfs") -> RequestValidator:
    return RequestValidator(
        AppArgs.model_validate(
            {
                "model": str(model),
                "served_model_name": "tiny",
                "engine": {"scheduling_policy": policy},
            }
        )
    )


@pytest.fixture(scope="module")
def validators(tiny_llama_with_tokenizer: Path) -> dict[str, RequestValidator]:
    return {p: make_validator(tiny_llama_with_tokenizer, p) for p in ("fcfs", "deadline")}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}


def refusal(call: Any, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(HTTPError) as info:
        call(body)
    response = error_response(info.value)
    assert response.status_code == 400, info.value
    return json.loads(response.body)["error"]


@pytest.mark.parametrize("route", ["completion", "chat"])
def test_deadline_and_priority_reach_the_engine_request(validators, route) -> None:
    validator = validators["deadline"]
    body = (completion if route == "completion" else chat)(deadline_ms=250, priority=-2)
    job = getattr(validator, route)(body)
    assert (job.deadline_ms, job.priority) == (250, -2)
    args = validator.args
    gen = Generation(args, backend=None, admission=Admission("t", 8))
    (req,) = gen.engine_requests(job, None)
    assert (req.deadline_ms, req.priority) == (250, -2)
    # Absent: no deadline.
    job = getattr(validator, route)((completion if route == "completion" else chat)())
    assert job.deadline_ms is None and job.priority == 0


@pytest.mark.parametrize("route", ["completion", "chat"])
@pytest.mark.parametrize(
    "bad",
    [0, -1, MAX_DEADLINE_MS + 1, float("nan"), float("inf"), "100", True, [5], {"ms": 5}],
    ids=repr,
)
def test_bad_deadlines_are_a_400_naming_the_field(validators, route, bad) -> None:
    validator = validators["deadline"]
    body = (completion if route == "completion" else chat)(deadline_ms=bad)
    error = refusal(getattr(validator, route), body)
    assert error["param"] == "deadline_ms" and error["type"] == "invalid_request_error"


def test_the_largest_deadline_is_accepted(validators) -> None:
    assert validators["deadline"].completion(completion(deadline_ms=MAX_DEADLINE_MS)).deadline_ms


@pytest.mark.parametrize("bad", [1.5, "1", None, 2**63, True])
def test_bad_priorities_are_a_400_naming_the_field(validators, bad) -> None:
    error = refusal(validators["deadline"].completion, completion(priority=bad))
    assert error["param"] == "priority"


def test_priority_under_a_policy_that_ignores_it_is_refused_as_vllm_does(validators) -> None:
    error = refusal(validators["fcfs"].chat, chat(priority=1))
    assert error["param"] == "priority" and "fcfs" in error["message"]
    # 0 is the default everywhere; deadlines are accepted under any policy.
    assert validators["fcfs"].chat(chat(priority=0, deadline_ms=5)).deadline_ms == 5


class DeadlineBackend:
    """Every stream ends at once with the engine replica's missed-deadline 429."""

    max_attempts = 3

    def __init__(self) -> None:
        self.opened = 0

    async def kv_namespace(self) -> str | None:
        return None

    def open(self, req: EngineRequest, index: int, num_prompts: int) -> Any:
        self.opened += 1
        return RejectedStream()


class RejectedStream:
    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        return EngineError(429, "deadline_ms: missed", "overloaded_error", DEADLINE_EXCEEDED)

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_a_missed_deadline_is_a_429_and_is_not_retried_elsewhere(validators, stream) -> None:
    validator = validators["deadline"]
    job = validator.completion(completion(deadline_ms=1, stream=stream))
    backend = DeadlineBackend()
    admission = Admission("t", 8)
    gen = Generation(validator.args, backend, admission)
    with pytest.raises(HTTPError) as info:
        asyncio.run(gen.run(job))
    body = json.loads(error_response(info.value).body)["error"]
    assert info.value.status == 429 and body["code"] == DEADLINE_EXCEEDED
    assert body["type"] == "overloaded_error" and "deadline_ms" in body["message"]
    assert backend.opened == 1 and admission.inflight == 0


def test_scheduling_metrics_are_exported_per_replica() -> None:
    metrics = ReplicaMetrics("r1")
    stats = EngineStats(num_blocks=100, num_preemptions=3, admission_watermark_blocks=61)
    stats.deadline_missed.update({"rejected": 2, "late": 1})
    metrics.update(stats)
    stats.deadline_missed["rejected"] += 1
    metrics.update(stats)
    text = render([metrics.snapshot()]).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    r = ("replica", "r1")
    assert samples[("prefixserve_kv_admission_watermark_blocks", (r,))] == 61
    assert samples[("prefixserve_num_preemptions_total", (r,))] == 3
    missed = "prefixserve_requests_deadline_missed_total"
    assert samples[(missed, (("action", "rejected"), r))] == 3
    assert samples[(missed, (("action", "late"), r))] == 1
