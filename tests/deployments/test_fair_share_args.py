"""The fair share's two inputs from the application: its engine option, validated with the other
``engine`` args, and the group id every engine request of one HTTP request carries."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.admission import Admission
from deployments.config import AppArgs
from deployments.generation import Generation
from deployments.validation import RequestValidator


def test_max_seqs_per_group_reaches_the_engine_config() -> None:
    assert AppArgs().engine_config().max_seqs_per_group is None
    args = AppArgs.model_validate({"engine": {"max_seqs_per_group": 2}})
    assert args.engine_config().max_seqs_per_group == 2
    with pytest.raises(ValidationError, match="max_seqs_per_group"):
        AppArgs.model_validate({"engine": {"max_seqs_per_group": 0}})


def test_every_prompt_of_one_request_carries_its_response_id_as_group(
    tiny_llama_with_tokenizer: Path,
) -> None:
    args = AppArgs.model_validate(
        {"model": str(tiny_llama_with_tokenizer), "served_model_name": "tiny"}
    )
    validator = RequestValidator(args)
    gen = Generation(args, backend=None, admission=Admission("t", 64))  # type: ignore[arg-type]
    body = {"model": "tiny", "prompt": ["Hello", "Bonjour", "Hallo"], "n": 4, "max_tokens": 2}
    job = validator.completion(body)
    requests = gen.engine_requests(job, None)
    assert len({r.request_id for r in requests}) == 3
    assert {r.group_id for r in requests} == {job.builder.id}
    # Another HTTP request is another group.
    (other,) = gen.engine_requests(validator.completion({**body, "prompt": "Hello"}), None)
    assert other.group_id != job.builder.id
