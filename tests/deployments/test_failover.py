"""Without a cluster: resuming a stream whose engine replica died mid-way (deployments.failover).

The text a client gets across the seam is checked against transformers' own decoding of every
token (cut at the first stop string, found with ``str.find``); the items of the dead and the new
replica are what an engine replica would send for those tokens. The live kill test is in
test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from deployments.engine_request import EngineRequest, StreamItem
from deployments.failover import (
    MAX_RESUMES,
    ChoiceProgress,
    PromptProgress,
    ResumedStream,
    SeamDetokenizer,
    resume_blocker,
    resume_request,
)
from deployments.openai_format import ResponseBuilder, usage
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputs
from tests.deployments.test_error_mapping import FakeBackend, FakeStream, make_generation

PROMPT_TEXT = "Once upon a time,"
TEXTS = [
    "Party time 🎉🎉 🧑‍🚀 👍🏽 done, 你好，世界。",
    "naïve café — Ünïcödé «quotes» ∑∫√ and the quick brown fox",
]


def engine_items(
    tokenizer: Any,
    prompt: list[int],
    tokens: list[int],
    params: SamplingParams,
    *,
    index: int = 0,
    before: int = 0,
    finish: bool = True,
) -> list[StreamItem]:
    """The items an engine replica sends for ``tokens`` (one per step) of a request whose
    prompt is ``prompt``: its own detokenizer's text deltas, stop strings included; the last
    item finishes the choice ("length") unless a stop string ended it first, or ``finish`` is
    off. ``before``: completion tokens already counted."""
    detok = IncrementalDetokenizer(
        tokenizer,
        params.skip_special_tokens,
        params.stop_strings,
        params.include_stop_str_in_output,
        prompt_token_ids=prompt,
    )
    items = []
    for n, token in enumerate(tokens, 1):
        stop = detok.append(token)
        finished = stop is not None or (finish and n == len(tokens))
        reason = "stop" if stop is not None else "length" if finished else None
        items.append(
            StreamItem(
                replica_id="r",
                index=index,
                token_ids=[token],
                text=detok.take_delta(finished),
                finished=finished,
                done=finished,
                finish_reason=reason,
                stop_reason=stop,
                prompt_tokens=len(prompt),
                completion_tokens=before + n,
                cached_tokens=0,
            )
        )
        if finished:
            break
    return items


def reference(tokenizer: Any, tokens: list[int], stop: str | None = None) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return text if stop is None or stop not in text else text[: text.find(stop)]


def across_seam(
    tokenizer: Any, prompt: list[int], tokens: list[int], seam: int, params: SamplingParams
) -> tuple[str, list[StreamItem]]:
    """The client's text and last items when the replica serving ``tokens`` dies after
    ``seam`` of them and a resumed request produces the rest."""
    sent = engine_items(tokenizer, prompt, tokens[:seam], params, finish=False)
    original = EngineRequest("cmpl-1", prompt, params)
    progress = PromptProgress(original, 0)
    for it in sent:
        progress.observe(it)
    choice = progress.choices[0]
    resumed = resume_request(original, 0, choice, 1, lambda ids: [])
    seam_detok = SeamDetokenizer(tokenizer, original, 0, choice)
    out = []
    for it in engine_items(
        tokenizer,
        resumed.prompt_token_ids,
        tokens[seam:],
        resumed.sampling,
        before=0,
    ):
        out.append(seam_detok.adjust(it))
        if out[-1].finished:
            break
    return "".join(i.text for i in sent + out), out


@pytest.mark.parametrize("text", TEXTS)
def test_text_across_any_seam_is_the_undisturbed_text(smollm2_tokenizer: Any, text: str) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode(PROMPT_TEXT)
    tokens = tok.encode(text)
    params = SamplingParams(max_tokens=len(tokens), temperature=0)
    # A stop string that never occurs still holds text back at every step.
    held = SamplingParams(max_tokens=len(tokens), temperature=0, stop=["@@never@@"])
    for p in (params, held):
        for seam in range(1, len(tokens)):
            got, out = across_seam(tok, prompt, tokens, seam, p)
            assert got == reference(tok, tokens), (seam, p.stop)
            assert out[-1].finish_reason == "length"
            assert out[-1].completion_tokens == len(tokens)
            assert out[-1].prompt_tokens == len(prompt)


def test_a_stop_string_across_the_seam_ends_the_choice(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode(PROMPT_TEXT)
    text = TEXTS[1]
    tokens = tok.encode(text)
    stop = "quick brown"
    params = SamplingParams(max_tokens=len(tokens), temperature=0, stop=[stop])
    # The token that completes the stop string, by transformers' decoding of each prefix.
    ends = next(m for m in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:m]))
    straddling = 0
    for seam in range(1, ends):
        got, out = across_seam(tok, prompt, tokens, seam, params)
        assert got == reference(tok, tokens, stop), seam
        last = out[-1]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
        assert last.completion_tokens == ends
        # The resumed request alone never sees the stop string when it began before the seam.
        straddling += stop not in tok.decode(tokens[seam:ends])
    assert straddling > 0


def test_resume_request_continues_after_the_tokens_sent() -> None:
    params = SamplingParams(
        max_tokens=20, min_tokens=5, temperature=0, prompt_logprobs=1, stop=["x"], seed=3
    )
    original = EngineRequest(
        "cmpl-1", [1, 2, 3], params, block_hashes=[9], deadline_ms=50.0, n=2, cache_salt="s"
    )
    choice = ChoiceProgress(token_ids=[7, 8, 9], text="abc")
    seen: list[list[int]] = []

    def hasher(ids: list[int]) -> list[int]:
        seen.append(ids)
        return [len(ids)]

    req = resume_request(original, 1, choice, 2, hasher)
    assert req.request_id == "cmpl-1-resume2-1"
    assert req.prompt_token_ids == [1, 2, 3, 7, 8, 9] and seen == [req.prompt_token_ids]
    assert req.block_hashes == [6]
    assert (req.n, req.deadline_ms, req.cache_salt) == (1, None, "s")
    s = req.sampling
    assert (s.max_tokens, s.min_tokens, s.prompt_logprobs) == (17, 2, None)
    assert s.seed == 4 and s.stop_strings.strings == ("x",)  # choice 1's seed
    # The original is left as it was.
    assert original.prompt_token_ids == [1, 2, 3] and params.max_tokens == 20
    assert (
        resume_request(
            original, 0, ChoiceProgress(token_ids=[1] * 6), 1, hasher
        ).sampling.min_tokens
        == 0
    )


def test_what_cannot_be_resumed() -> None:
    assert resume_blocker(SamplingParams(temperature=0)) is None
    assert resume_blocker(SamplingParams(temperature=0, seed=1)) is None  # greedy: no draws
    assert resume_blocker(SamplingParams(temperature=0.8)) is None  # a sample of the same law
    assert resume_blocker(SamplingParams(repetition_penalty=1.2)) is None
    assert "seed" in resume_blocker(SamplingParams(temperature=0.8, seed=1))
    assert "penalt" in resume_blocker(SamplingParams(frequency_penalty=0.5))
    assert "penalt" in resume_blocker(SamplingParams(presence_penalty=0.5))
    structured = SamplingParams(structured_outputs=StructuredOutputs(choice=["a", "b"]))
    assert "grammar" in resume_blocker(structured)


def test_usage_is_the_original_requests(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    tokens = tok.encode(TEXTS[0])
    params = SamplingParams(max_tokens=len(tokens), temperature=0)
    original = EngineRequest("cmpl-1", tok.encode(PROMPT_TEXT), params)
    sent = engine_items(tok, original.prompt_token_ids, tokens[:4], params, finish=False)
    for it in sent:
        it.cached_tokens = 3
    progress = PromptProgress(original, 0)
    for it in sent:
        progress.observe(it)
    resumed = resume_request(original, 0, progress.choices[0], 1, lambda ids: [])
    seam = SeamDetokenizer(tok, original, 0, progress.choices[0])
    # The new replica counts its own (longer) prompt and finds it all cached.
    new = engine_items(tok, resumed.prompt_token_ids, tokens[4:], resumed.sampling)
    for it in new:
        it.cached_tokens = len(resumed.prompt_token_ids)
    last = [seam.adjust(it) for it in new][-1]
    assert usage([last]) == {
        "prompt_tokens": len(original.prompt_token_ids),
        "completion_tokens": len(tokens),
        "total_tokens": len(original.prompt_token_ids) + len(tokens),
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_resumed_stream_finishes_when_its_choices_do() -> None:
    a = FakeStream(item(0, [5], False), item(0, [6], True))
    b = FakeStream(item(0, [7], True))
    original = EngineRequest("cmpl-1", [1], SamplingParams(max_tokens=4), n=3)
    seams = [
        SeamDetokenizer(None, original, k, ChoiceProgress(token_ids=[4, 4], prompt_tokens=1))
        for k in (0, 2)
    ]

    async def run() -> list[StreamItem]:
        stream = ResumedStream([(seams[0], a), (seams[1], b)])
        got = [await stream.__anext__() for _ in range(3)]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        return got

    got = asyncio.run(run())
    assert sorted((i.index, i.token_ids, i.finished) for i in got) == [
        (0, [5], False),
        (0, [6], True),
        (2, [7], True),
    ]
    # Only the last item ends the prompt's stream; counts include the tokens sent before.
    assert [i.done for i in got] == [False, False, True]
    assert [(i.index, i.completion_tokens, i.prompt_tokens) for i in got if i.finished] in (
        [(0, 4, 1), (2, 3, 1)],
        [(2, 3, 1), (0, 4, 1)],
    )


def item(index: int, tokens: list[int], finished: bool) -> StreamItem:
    return StreamItem(
        replica_id="r2",
        index=index,
        token_ids=tokens,
        text="",
        finished=finished,
        done=finished,
        finish_reason="length" if finished else None,
        stop_reason=None,
        prompt_tokens=9,
        completion_tokens=0,
        cached_tokens=9,
    )


def sse_events(chunks: list[bytes]) -> list[Any]:
    out = []
    for chunk in chunks:
        data = chunk.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_response(
    gen: Any, original: EngineRequest, first: FakeStream, tokenizer: Any
) -> list[Any]:
    """The SSE events of ``original`` (one prompt) whose first engine stream is ``first``."""
    builder = ResponseBuilder("completion", "cmpl-1", "tiny", tokenizer, n=original.n)
    lease = gen.admission.lease(1, original.n)
    lease.streams[0] = first

    async def run() -> list[bytes]:
        head = await first.__anext__()
        return [b async for b in gen._sse(lease, [original], [head], builder, True)]

    events = sse_events(asyncio.run(run()))
    assert gen.admission.inflight == 0
    return events


def texts_by_choice(events: list[Any], n: int) -> tuple[list[str], list[str | None]]:
    texts, reasons = [""] * n, [None] * n
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            texts[c["index"]] += c["text"]
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    return texts, reasons


def test_a_dead_replicas_choices_resume_and_the_client_sees_no_seam(
    smollm2_tokenizer: Any,
) -> None:
    """n = 2: each unfinished choice resumes on its own, after its own tokens; the stream
    fails again and resumes again; the client's text and usage are an undisturbed run's."""
    tok = smollm2_tokenizer
    prompt = tok.encode(PROMPT_TEXT)
    outs = [tok.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=max(map(len, outs)), temperature=0)
    original = EngineRequest("cmpl-1", prompt, params, n=2)
    sent = [
        engine_items(tok, prompt, o[:3], params, index=k, finish=False) for k, o in enumerate(outs)
    ]
    first = FakeStream(*[x for pair in zip(*sent, strict=True) for x in pair], ActorDiedError())

    def rest(k: int, start: int, stop: int, die: bool) -> FakeStream:
        items = engine_items(
            tok, prompt + outs[k][:start], outs[k][start:stop], params, finish=not die
        )
        return FakeStream(*items, ActorDiedError()) if die else FakeStream(*items)

    # Resumption 1: choice 0 finishes; choice 1 gets 2 more tokens, then its replica dies.
    # Resumption 2: choice 1 alone, after its 5 tokens.
    backend = FakeBackend(
        rest(0, 3, len(outs[0]), die=False),
        rest(1, 3, 5, die=True),
        rest(1, 5, len(outs[1]), die=False),
    )
    gen = make_generation(backend=backend)
    events = stream_response(gen, original, first, tok)
    texts, reasons = texts_by_choice(events, 2)
    assert texts == [tok.decode(o) for o in outs]
    assert reasons == ["length", "length"]
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    assert events[-2]["usage"]["prompt_tokens"] == len(prompt)
    assert events[-2]["usage"]["completion_tokens"] == sum(map(len, outs))
    assert [p for p, _, _ in backend.opened] == [
        prompt + outs[0][:3],
        prompt + outs[1][:3],
        prompt + outs[1][:5],
    ]
    assert gen.admission.metrics.failovers._value.get() == 3
    assert first.cancelled == 1


def error_of(events: list[Any]) -> dict[str, Any]:
    assert events[-1] == "[DONE]"
    return events[-2]["error"]


def test_a_stream_resumed_max_times_then_ends_with_an_error_event() -> None:
    original = EngineRequest("cmpl-1", [1, 2], SamplingParams(max_tokens=50, temperature=0))
    first = FakeStream(item(0, [3], False), ActorDiedError())
    again = [FakeStream(item(0, [4], False), ActorDiedError()) for _ in range(MAX_RESUMES)]
    gen = make_generation(backend=FakeBackend(*again))
    events = stream_response(gen, original, first, None)
    assert error_of(events)["code"] == "engine_unavailable"
    assert gen.admission.metrics.failovers._value.get() == MAX_RESUMES
    assert [len(c["choices"][0]["text"]) for c in events[:-2]] == [0] * (1 + MAX_RESUMES)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=50, temperature=0.7, seed=11),
        SamplingParams(max_tokens=50, temperature=0, frequency_penalty=0.5),
    ],
)
def test_a_stream_that_cannot_resume_ends_with_an_error_event(params: SamplingParams) -> None:
    original = EngineRequest("cmpl-1", [1, 2], params)
    first = FakeStream(item(0, [3], False), ActorDiedError())
    backend = FakeBackend()
    gen = make_generation(backend=backend)
    events = stream_response(gen, original, first, None)
    assert error_of(events)["code"] == "engine_unavailable"
    assert backend.opened == [] and gen.admission.metrics.failovers._value.get() == 0


def test_the_direct_layouts_local_engine_is_not_resumed() -> None:
    class LocalLike(FakeBackend):
        max_attempts = 1

    original = EngineRequest("cmpl-1", [1, 2], SamplingParams(max_tokens=50, temperature=0))
    backend = LocalLike()
    gen = make_generation(backend=backend)
    events = stream_response(gen, original, FakeStream(item(0, [3], False), ActorDiedError()), None)
    assert error_of(events)["code"] == "engine_unavailable"
    assert backend.opened == []


def test_a_resumed_request_that_meets_a_dead_replica_is_opened_again() -> None:
    """A resumed request that fails before any item (the router still knew the dead replica)
    is opened again without counting a failover; the client sees nothing of it."""
    original = EngineRequest("cmpl-1", [1, 2], SamplingParams(max_tokens=3, temperature=0))
    first = FakeStream(item(0, [3], False), ActorDiedError())
    backend = FakeBackend(
        FakeStream(ActorDiedError()), FakeStream(item(0, [4], False), item(0, [5], True))
    )
    gen = make_generation(backend=backend)
    events = stream_response(gen, original, first, None)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
    assert [c["choices"][0]["finish_reason"] for c in events[:-2]] == [None, None, "length"]
    assert [p for p, _, _ in backend.opened] == [[1, 2, 3], [1, 2, 3]]
    assert gen.admission.metrics.failovers._value.get() == 1
