"""The request schema's bounds, without a cluster: every bound admits its limit and answers one
past it with a 400 whose OpenAI-style body names the field; integers too large for native code
answer a range message, never an internal one; admission counts sequences (prompts x n)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.admission import Admission
from deployments.chat_protocol import ChatCompletionRequest
from deployments.config import AppArgs
from deployments.engine_request import EngineError, EngineRequest
from deployments.generation import Generation
from deployments.http_errors import HTTPError, error_response
from deployments.openai_format import ResponseBuilder
from deployments.request_limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_BAD_WORDS,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from deployments.validation import GenerationJob, RequestValidator
from engine.sampling_params import SamplingParams

VOCAB = 49152  # the tiny model shares SmolLM2's tokenizer and vocabulary
NO_HEALTH_CHECK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def make_validator(model: Path, **limits: Any) -> RequestValidator:
    return RequestValidator(
        AppArgs.model_validate({"model": str(model), "served_model_name": "tiny", "limits": limits})
    )


@pytest.fixture(scope="module")
def validator(tiny_llama_with_tokenizer: Path) -> RequestValidator:
    return make_validator(tiny_llama_with_tokenizer)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        **fields,
    }


def refusal(call: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-style error body ``call(body)`` answers; it must be a 400."""
    with pytest.raises(HTTPError) as info:
        call(body)
    response = error_response(info.value)
    assert response.status_code == 400, info.value
    return json.loads(response.body)["error"]


# (body at the limit, body one past it, the field the 400 names, words of its message)
BOUNDS = {
    "stop count": (
        completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
        completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
        "stop",
        f"at most {MAX_STOP_STRINGS} items",
    ),
    "stop string length": (
        completion(stop="x" * MAX_STOP_STRING_CHARS),
        completion(stop="x" * (MAX_STOP_STRING_CHARS + 1)),
        "stop",
        f"at most {MAX_STOP_STRING_CHARS} characters",
    ),
    "stop string length in a list": (
        completion(stop=["a", "x" * MAX_STOP_STRING_CHARS]),
        completion(stop=["a", "x" * (MAX_STOP_STRING_CHARS + 1)]),
        "stop",
        f"at most {MAX_STOP_STRING_CHARS} characters",
    ),
    "stop_token_ids count": (
        completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
        completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
        "stop_token_ids",
        f"at most {MAX_STOP_TOKEN_IDS} items",
    ),
    "stop_token_ids vocabulary": (
        completion(stop_token_ids=[VOCAB - 1]),
        completion(stop_token_ids=[VOCAB]),
        "stop_token_ids",
        f"[0, {VOCAB})",
    ),
    "bad_words count": (
        completion(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)]),
        completion(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)]),
        "bad_words",
        f"at most {MAX_BAD_WORDS} items",
    ),
    "bad_words blank": (
        completion(bad_words=["w"]),
        completion(bad_words=["w", " "]),
        "bad_words",
        "non-blank",
    ),
    "allowed_token_ids vocabulary": (
        completion(allowed_token_ids=[0, VOCAB - 1]),
        completion(allowed_token_ids=[0, VOCAB]),
        "allowed_token_ids",
        f"[0, {VOCAB})",
    ),
    "allowed_token_ids count": (
        completion(allowed_token_ids=[1]),
        completion(allowed_token_ids=[]),
        "allowed_token_ids",
        "at least 1 item",
    ),
    "logit_bias count": (
        completion(logit_bias={str(t): 1.0 for t in range(MAX_LOGIT_BIAS)}),
        completion(logit_bias={str(t): 1.0 for t in range(MAX_LOGIT_BIAS + 1)}),
        "logit_bias",
        f"at most {MAX_LOGIT_BIAS} items",
    ),
    "n": (completion(n=MAX_N), completion(n=MAX_N + 1), "n", f"less than or equal to {MAX_N}"),
    "prompts": (
        completion(prompt=["a"] * MAX_PROMPTS),
        completion(prompt=["a"] * (MAX_PROMPTS + 1)),
        "prompt",
        f"at most {MAX_PROMPTS} prompts",
    ),
    "prompts x n": (
        completion(prompt=["a"] * (MAX_SEQUENCES // MAX_N), n=MAX_N),
        completion(prompt=["a"] * (MAX_SEQUENCES // MAX_N + 1), n=MAX_N),
        "n",
        f"at most {MAX_SEQUENCES} per request",
    ),
    "chat n": (chat(n=MAX_N), chat(n=MAX_N + 1), "n", f"less than or equal to {MAX_N}"),
    "chat stop count": (
        chat(stop=["x"] * MAX_STOP_STRINGS),
        chat(stop=["x"] * (MAX_STOP_STRINGS + 1)),
        "stop",
        f"at most {MAX_STOP_STRINGS} items",
    ),
    "chat logit_bias count": (
        chat(logit_bias={str(t): -1 for t in range(MAX_LOGIT_BIAS)}),
        chat(logit_bias={str(t): -1 for t in range(MAX_LOGIT_BIAS + 1)}),
        "logit_bias",
        f"at most {MAX_LOGIT_BIAS} items",
    ),
    "message parts": (
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 200}]),
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": ""}] * (MAX_CONTENT_PARTS + 1),
                }
            ]
        ),
        "messages",
        f"at most {MAX_CONTENT_PARTS} parts",
    ),
}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_each_bound_admits_its_limit_and_refuses_one_past_it(
    validator: RequestValidator, name: str
) -> None:
    at_limit, past, param, words = BOUNDS[name]
    call = validator.chat if "messages" in at_limit else validator.completion
    job = call(at_limit)
    assert isinstance(job, GenerationJob)
    error = refusal(call, past)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert words in error["message"], error["message"]


def test_messages_are_bounded_in_count_and_size(validator: RequestValidator) -> None:
    """At the schema: the limits themselves parse (a real chat template over a thousand
    messages would outgrow the tiny model's context, a different 400)."""
    message = {"role": "user", "content": "x"}
    assert (
        len(ChatCompletionRequest.model_validate(chat(messages=[message] * MAX_MESSAGES)).messages)
        == MAX_MESSAGES
    )
    big = {"role": "user", "content": "x" * MAX_MESSAGE_CHARS}
    ChatCompletionRequest.model_validate(chat(messages=[big]))
    parts = [{"type": "text", "text": "x" * (MAX_MESSAGE_CHARS // 2)}] * 2
    ChatCompletionRequest.model_validate(chat(messages=[{"role": "user", "content": parts}]))

    error = refusal(validator.chat, chat(messages=[message] * (MAX_MESSAGES + 1)))
    assert error["param"] == "messages" and f"at most {MAX_MESSAGES} items" in error["message"]
    for content in ("x" * (MAX_MESSAGE_CHARS + 1), [*parts, {"type": "text", "text": "x"}]):
        error = refusal(
            validator.chat, chat(messages=[message, {"role": "user", "content": content}])
        )
        assert error["param"] == "messages"
        assert error["message"].startswith("messages.1: content:"), error["message"]
        assert f"at most {MAX_MESSAGE_CHARS} per message" in error["message"]


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/a.png"}}, "has type 'image_url'"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio'"),
        ("just a string", "is not a text part"),
        ({"text": "no type"}, "is not a text part"),
        ({"type": "text", "text": 5}, "text must be a string"),
        ({"type": "text"}, "text must be a string"),
    ],
)
def test_a_part_the_model_cannot_take_is_named(
    validator: RequestValidator, part: object, words: str
) -> None:
    """Not the union's first branch ("content.str: Input should be a valid string"): the
    message says which part of which message, and what is wrong with it."""
    content = [{"type": "text", "text": "Describe this:"}, part]
    error = refusal(validator.chat, chat(messages=[{"role": "user", "content": content}]))
    assert error["param"] == "messages"
    assert error["message"].startswith("messages.0.content: content part 1"), error["message"]
    assert words in error["message"], error["message"]
    assert "valid string" not in error["message"]


def test_text_like_parts_are_read_as_vllm_reads_them(validator: RequestValidator) -> None:
    """As vLLM's chat parser takes them for a text-only model: OpenAI's text and refusal parts
    (a client replaying an assistant turn) and the Responses API's input and output text, in
    any role, their texts joined by newlines."""
    turns = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Do something bad."},
                {"type": "input_text", "text": "Now."},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "Sorry."},
                {"type": "refusal", "refusal": "I can't help with that."},
            ],
        },
        {"role": "user", "content": "Then say hi."},
    ]
    request = ChatCompletionRequest.model_validate(chat(messages=turns))
    assert [m.text() for m in request.messages] == [
        "Do something bad.\nNow.",
        "Sorry.\nI can't help with that.",
        "Then say hi.",
    ]
    assert isinstance(validator.chat(chat(messages=turns)), GenerationJob)

    broken = [{"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}]
    error = refusal(validator.chat, chat(messages=broken))
    assert error["message"] == "messages.0.content: content part 0: refusal must be a string"


def test_huge_seed_gets_a_range_message(validator: RequestValidator) -> None:
    for call, body in ((validator.completion, completion), (validator.chat, chat)):
        error = refusal(call, body(seed=2**70))
        assert error["param"] == "seed"
        assert error["message"] == f"seed: Input should be less than or equal to {INT64_MAX}"
        assert "Overflow" not in error["message"]


COMPLETION_INTS = [
    "seed",
    "max_tokens",
    "top_k",
    "min_tokens",
    "priority",
    "logprobs",
    "n",
    "best_of",
]
CHAT_INTS = [
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "top_k",
    "min_tokens",
    "priority",
    "top_logprobs",
    "n",
]
beyond_int64 = st.one_of(
    st.integers(min_value=INT64_MAX + 1, max_value=2**200),
    st.integers(min_value=-(2**200), max_value=INT64_MIN - 1),
)


@settings(max_examples=60, deadline=None, suppress_health_check=NO_HEALTH_CHECK)
@given(kind=st.sampled_from(["completion", "chat"]), data=st.data(), value=beyond_int64)
def test_integers_beyond_64_bits_name_their_field(
    validator: RequestValidator, kind: str, data: st.DataObject, value: int
) -> None:
    field = data.draw(st.sampled_from(COMPLETION_INTS if kind == "completion" else CHAT_INTS))
    call, body = (
        (validator.completion, completion) if kind == "completion" else (validator.chat, chat)
    )
    error = refusal(call, body(**{field: value}))
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: Input should be "), error["message"]
    assert "than or equal to" in error["message"] and "Overflow" not in error["message"]


@settings(max_examples=150, deadline=None, suppress_health_check=NO_HEALTH_CHECK)
@given(
    kind=st.sampled_from(["completion", "chat"]),
    data=st.data(),
    value=st.integers(min_value=INT64_MIN, max_value=INT64_MAX),
)
def test_any_64_bit_integer_is_served_or_a_400_naming_its_field(
    validator: RequestValidator, kind: str, data: st.DataObject, value: int
) -> None:
    """No integer a client sends reaches the engine unchecked: it is admitted with values every
    later stage accepts (a seed for each choice seeds a generator), or it is a 400 naming it."""
    import torch

    from deployments.choices import choice_params

    field = data.draw(st.sampled_from(COMPLETION_INTS if kind == "completion" else CHAT_INTS))
    call, body = (
        (validator.completion, completion) if kind == "completion" else (validator.chat, chat)
    )
    # A seeded request's choices draw with seed + k: the widest request tests them all.
    extra = {"n": MAX_N} if field == "seed" else {}
    try:
        job = call(body(**{field: value}, **extra))
    except HTTPError as e:
        assert e.status == 400 and e.param == field, (e.status, e.param, str(e))
        return
    for k in range(job.n):
        seed = choice_params(job.params, k).seed
        if seed is not None:
            torch.Generator().manual_seed(seed)


@settings(max_examples=80, deadline=None, suppress_health_check=NO_HEALTH_CHECK)
@given(
    stop=st.lists(
        st.text(min_size=0, max_size=MAX_STOP_STRING_CHARS + 8), max_size=MAX_STOP_STRINGS + 4
    ),
    stop_token_ids=st.lists(st.integers(-5, VOCAB + 5), max_size=MAX_STOP_TOKEN_IDS + 4),
    bias_count=st.integers(0, MAX_LOGIT_BIAS + 4),
)
def test_stop_and_bias_lists_are_admitted_exactly_within_their_bounds(
    validator: RequestValidator, stop: list[str], stop_token_ids: list[int], bias_count: int
) -> None:
    body = completion(
        stop=stop,
        stop_token_ids=stop_token_ids,
        logit_bias={str(t): 0.5 for t in range(bias_count)},
    )
    faults = []
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS or not s for s in stop):
        faults.append("stop")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < VOCAB for t in stop_token_ids):
        faults.append("stop_token_ids")
    if bias_count > MAX_LOGIT_BIAS:
        faults.append("logit_bias")
    if not faults:
        job = validator.completion(body)
        assert list(job.params.stop_strings) == stop
        assert job.params.stop_token_ids == frozenset(stop_token_ids)
        return
    assert refusal(validator.completion, body)["param"] in faults


def test_the_choices_of_a_request_share_its_stop_set(validator: RequestValidator) -> None:
    from deployments.choices import choice_params

    job = validator.completion(
        completion(prompt=["a", "b"], n=MAX_N, seed=9, stop=["x"] * MAX_STOP_STRINGS)
    )
    choices = [choice_params(job.params, k) for k in range(job.n)]
    assert [c.seed for c in choices] == list(range(9, 9 + MAX_N))
    assert all(c.stop is job.params.stop and c.logit_bias is job.params.logit_bias for c in choices)


# -- admission counts sequences -----------------------------------------------------------------


def test_a_request_wider_than_the_admission_limit_is_a_400(tiny_llama_with_tokenizer: Path) -> None:
    small = make_validator(tiny_llama_with_tokenizer, max_ongoing_per_ingress=8)
    assert small.completion(completion(prompt=["a", "b"], n=4)).num_sequences == 8
    error = refusal(small.completion, completion(prompt=["a", "b", "c"], n=3))
    assert error["param"] == "n" and "9 sequences" in error["message"]
    error = refusal(small.completion, completion(prompt=["a"] * 9))
    assert error["param"] == "prompt"
    error = refusal(small.chat, chat(n=9))
    assert error["param"] == "n" and "at most 8 at once" in error["message"]


class RecordingBackend:
    """Records the admission count each engine stream opens under; every stream fails with a
    client error, so the request ends at once."""

    max_attempts = 1

    def __init__(self) -> None:
        self.admission: Admission | None = None
        self.seen: list[int] = []

    def open(self, req: EngineRequest, index: int, num_prompts: int) -> Any:
        assert self.admission is not None
        self.seen.append(self.admission.inflight)
        return FailingStream()

    async def kv_namespace(self) -> str | None:
        return None


class FailingStream:
    async def __anext__(self) -> Any:
        await asyncio.sleep(0)  # every prompt's stream opens before the first one fails
        return EngineError(400, "bad", "invalid_request_error")

    def cancel(self) -> None:
        pass


def job_of(prompts: int, n: int) -> GenerationJob:
    return GenerationJob(
        prompts=[[5 + i] for i in range(prompts)],
        params=SamplingParams(),
        builder=ResponseBuilder("completion", "cmpl-t", "tiny", None, n, num_prompts=prompts),
        n=n,
        stream=False,
        include_usage=False,
        priority=0,
    )


def test_admission_counts_prompts_times_n() -> None:
    args = AppArgs.model_validate({"limits": {"max_ongoing_per_ingress": 40}})
    admission = Admission("test", args.limits.max_ongoing_per_ingress)
    backend = RecordingBackend()
    backend.admission = admission
    gen = Generation(args, backend, admission)

    with pytest.raises(HTTPError, match="bad"):
        asyncio.run(gen.run(job_of(4, 8)))
    assert backend.seen == [32, 32, 32, 32]  # one request of 4 prompts x n=8 holds 32 units
    assert admission.inflight == 0 and admission.metrics.peak == 32

    held = admission.lease(1, 10)  # 10 sequences of another request
    with pytest.raises(HTTPError) as info:
        asyncio.run(gen.run(job_of(4, 8)))  # 10 + 32 > 40
    assert info.value.status == 429 and "32 more asked" in str(info.value)
    assert admission.inflight == 10 and len(backend.seen) == 4
    gen.check_capacity(30)  # 10 + 30 fits
    held.release()
    assert admission.inflight == 0


def test_a_prompt_that_fills_the_context_is_refused_on_its_own_field(
    validator: RequestValidator,
) -> None:
    """The prompt alone leaves no room for a token: the error names the prompt's field (chat's
    default max_tokens is derived, not the client's), with OpenAI's code; a prompt that fits
    with too large a max_tokens still names max_tokens."""
    full = [100 + i % 1000 for i in range(validator.max_model_len)]
    error = refusal(validator.completion, completion(prompt=full, max_tokens=1))
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert f"(prompt) alone is {validator.max_model_len} tokens" in error["message"]
    words = "word " * (validator.max_model_len + 10)
    body = {"model": "tiny", "messages": [{"role": "user", "content": words}]}
    error = refusal(validator.chat, body)
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    error = refusal(validator.completion, completion(prompt=full[:-8], max_tokens=9))
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert validator.completion(completion(prompt=full[:-8], max_tokens=8)).prompts[0] == full[:-8]


def test_best_of_below_n_is_refused(validator: RequestValidator) -> None:
    """OpenAI: best_of candidates, of which n are returned, so best_of must be at least n."""
    error = refusal(validator.completion, completion(n=2, best_of=1))
    assert error["param"] == "best_of"
    assert "at least n" in error["message"]
    assert len(validator.completion(completion(n=2)).prompts) == 1
    assert validator.completion(completion(best_of=1)).prompts
