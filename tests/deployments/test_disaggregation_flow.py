"""Without a cluster: the ingress's side of prefill/decode disaggregation (deployments.disaggregation).

The prefill and decode replicas are scripted streams of the items an engine replica would send
(test_failover.engine_items); the client's text is checked against transformers' own decoding
of every token, cut at the first stop string.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError
from ray.exceptions import ActorDiedError

from deployments.admission import Admission
from deployments.config import AppArgs
from deployments.cpu_affinity import engine_cpus
from deployments.disaggregation import eligible, prefill_request
from deployments.engine_request import EngineRequest
from deployments.generation import Generation
from deployments.openai_format import ResponseBuilder
from engine.sampling_params import SamplingParams
from router.slo import VERDICTS
from tests.deployments.test_error_mapping import FakeBackend, FakeStream, engine_error
from tests.deployments.test_failover import TEXTS, engine_items, reference, sse_events

PROMPT = list(range(1000, 1080))  # 5 full blocks of 16


def _generation(decode: FakeBackend, prefill: FakeBackend, **disaggregation: Any) -> Generation:
    args = AppArgs.model_validate(
        {"layout": "routed", "disaggregation": {"enabled": True, **disaggregation}}
    )
    return Generation(args, decode, Admission("test", 100), prefill)


def _handoffs(gen: Generation, outcome: str) -> float:
    assert gen.prefill_first is not None
    return gen.prefill_first.metrics.outcomes.labels(ingress="test", outcome=outcome)._value.get()


def _respond(gen: Generation, original: EngineRequest, tokenizer: Any) -> list[Any]:
    """The SSE events of a streamed one-prompt request."""
    builder = ResponseBuilder("completion", "cmpl-1", "tiny", tokenizer)

    async def run() -> list[bytes]:
        lease = gen.admission.lease(1, 1)
        first = await gen._open(lease, 0, original, 1, tokenizer)
        out = [b async for b in gen._sse(lease, [original], [first], builder, True)]
        await asyncio.gather(*gen.prefill_first._draining)
        return out

    events = sse_events(asyncio.run(run()))
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict)), events[-2]
    assert gen.admission.inflight == 0
    return events


def _text(events: list[Any]) -> tuple[str, str | None, dict[str, Any]]:
    text, reason = "", None
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            text += e["choices"][0]["text"]
            reason = e["choices"][0]["finish_reason"] or reason
    return text, reason, events[-2]["usage"]


def _prefill_stream(tok: Any, out: list[int], params: SamplingParams) -> FakeStream:
    """What the prefill replica sends: the first token, finished at its max_tokens of 1."""
    items = engine_items(
        tok, PROMPT, out[:1], prefill_request(EngineRequest("x", PROMPT, params)).sampling
    )
    items[-1].handoff_blocks, items[-1].handoff_bytes = 5, 5000
    return FakeStream(*items)


@pytest.mark.parametrize("stop", [None, "stop-at-seam"])
@pytest.mark.parametrize("text", TEXTS)
def test_handed_off_text_is_the_undisturbed_text(
    smollm2_tokenizer: Any, text: str, stop: str | None
) -> None:
    """The prefill's first token, then the decode side's: the text, finish reason and usage a
    colocated run sends, a stop string that straddles the seam included."""
    tok = smollm2_tokenizer
    out = tok.encode(text)
    if stop is not None:
        # The end of the first token's text (which the prefill replica flushed, finished) and
        # the start of the next one's.
        first, two = tok.decode(out[:1]), tok.decode(out[:2])
        stop = first[-2:] + two[len(first) : len(first) + 1]
        assert stop not in first and two.startswith(first)
    params = SamplingParams(max_tokens=len(out), temperature=0, stop=[stop] if stop else None)
    original = EngineRequest("cmpl-1", PROMPT, params)
    decode_items = engine_items(tok, PROMPT + out[:1], out[1:], params)
    decode, prefill = (
        FakeBackend(FakeStream(*decode_items)),
        FakeBackend(_prefill_stream(tok, out, params)),
    )
    gen = _generation(decode, prefill)
    text_sent, reason, usage = _text(_respond(gen, original, tok))
    assert text_sent == reference(tok, out, stop)
    assert reason == ("stop" if stop else "length")
    assert usage["prompt_tokens"] == len(PROMPT)
    if stop is None:
        assert usage["completion_tokens"] == len(out)
    # The prefill ran the prompt alone; the decode side the prompt and the first token.
    assert [p for p, _, _ in prefill.opened] == [PROMPT]
    assert [p for p, _, _ in decode.opened] == [PROMPT + out[:1]]
    assert _handoffs(gen, "handed_off") == 1
    assert gen.prefill_first is not None
    assert gen.prefill_first.metrics.bytes._value.get() == 5000


def test_a_choice_that_ends_at_its_first_token_never_reaches_the_decode_side(
    smollm2_tokenizer: Any,
) -> None:
    tok = smollm2_tokenizer
    out = tok.encode(TEXTS[0])[:1] + [tok.eos_token_id]
    params = SamplingParams(max_tokens=20, temperature=0)
    items = engine_items(tok, PROMPT, out[:1], params)
    items[-1].finish_reason = "stop"  # the engine stopped at EOS after it
    decode, prefill = FakeBackend(), FakeBackend(FakeStream(*items))
    gen = _generation(decode, prefill)
    text, reason, usage = _text(_respond(gen, EngineRequest("cmpl-1", PROMPT, params), tok))
    assert (text, reason, usage["completion_tokens"]) == (tok.decode(out[:1]), "stop", 1)
    assert decode.opened == []
    assert _handoffs(gen, "ended_at_prefill") == 1


def test_no_prefill_replica_means_the_prompt_runs_colocated(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    out = tok.encode(TEXTS[1])
    params = SamplingParams(max_tokens=len(out), temperature=0)
    dead = [FakeStream(ActorDiedError()) for _ in range(3)]
    decode = FakeBackend(FakeStream(*engine_items(tok, PROMPT, out, params)))
    gen = _generation(decode, FakeBackend(*dead))
    text, reason, _ = _text(_respond(gen, EngineRequest("cmpl-1", PROMPT, params), tok))
    assert (text, reason) == (tok.decode(out), "length")
    assert [p for p, _, _ in decode.opened] == [PROMPT]
    assert _handoffs(gen, "colocated_fallback") == 1


def test_a_decode_replica_lost_mid_stream_is_failed_over(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    out = tok.encode(TEXTS[0])
    params = SamplingParams(max_tokens=len(out), temperature=0)
    dies = engine_items(tok, PROMPT + out[:1], out[1:4], params, finish=False)
    rest = engine_items(tok, PROMPT + out[:4], out[4:], params)
    decode = FakeBackend(FakeStream(*dies, ActorDiedError()), FakeStream(*rest))
    gen = _generation(decode, FakeBackend(_prefill_stream(tok, out, params)))
    text, reason, usage = _text(_respond(gen, EngineRequest("cmpl-1", PROMPT, params), tok))
    assert (text, reason, usage["completion_tokens"]) == (tok.decode(out), "length", len(out))
    assert [p for p, _, _ in decode.opened] == [PROMPT + out[:1], PROMPT + out[:4]]
    assert gen.admission.metrics.failovers._value.get() == 1


def test_a_handoff_no_decode_replica_has_room_for_ends_with_a_429_event(
    smollm2_tokenizer: Any,
) -> None:
    """Every decode replica refuses (full): tried on others, then the stream, whose first token
    went out, ends with the 429 as its error event; never silently."""
    tok = smollm2_tokenizer
    out = tok.encode(TEXTS[1])
    params = SamplingParams(max_tokens=len(out), temperature=0)
    full = [
        FakeStream(engine_error(429, "engine replica overloaded", "overloaded_error", "overloaded"))
        for _ in range(3)
    ]
    decode = FakeBackend(*full)
    gen = _generation(decode, FakeBackend(_prefill_stream(tok, out, params)))
    builder = ResponseBuilder("completion", "cmpl-1", "tiny", tok)
    original = EngineRequest("cmpl-1", PROMPT, params)

    async def run() -> list[bytes]:
        lease = gen.admission.lease(1, 1)
        first = await gen._open(lease, 0, original, 1, tok)
        return [b async for b in gen._sse(lease, [original], [first], builder, False)]

    events = sse_events(asyncio.run(run()))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "overloaded"
    sent = "".join(e["choices"][0]["text"] for e in events[:-2] if e.get("choices"))
    assert sent == tok.decode(out[:1])
    assert len(decode.opened) == 3
    assert gen.admission.inflight == 0


class SloRoutedBackend(FakeBackend):
    """Records each request's SLO and a verdict on it, as the decode side's router does."""

    def __init__(self, *streams: FakeStream, met: bool) -> None:
        super().__init__(*streams)
        self.met = met
        self.slos: list[float | None] = []

    def open(self, req: EngineRequest, *args: Any, **kwargs: Any) -> FakeStream:
        self.slos.append(req.tbt_slo_ms)
        if req.tbt_slo_ms is not None:
            VERDICTS.record(req.request_id, self.met)
        return super().open(req, *args, **kwargs)


@pytest.mark.parametrize("met", [True, False])
def test_the_decode_side_is_routed_by_the_slo_and_misses_are_counted(
    smollm2_tokenizer: Any, met: bool
) -> None:
    tok = smollm2_tokenizer
    out = tok.encode(TEXTS[0])
    params = SamplingParams(max_tokens=len(out), temperature=0)
    decode = SloRoutedBackend(
        FakeStream(*engine_items(tok, PROMPT + out[:1], out[1:], params)), met=met
    )
    prefill = SloRoutedBackend(_prefill_stream(tok, out, params), met=met)
    gen = _generation(decode, prefill, tbt_slo_ms=50)
    _respond(gen, EngineRequest("cmpl-1", PROMPT, params), tok)
    assert (prefill.slos, decode.slos) == ([None], [50.0])
    assert gen.prefill_first is not None
    assert gen.prefill_first.metrics.tbt_slo_misses._value.get() == (0 if met else 1)
    assert VERDICTS.take("cmpl-1-decode") is None  # taken when the first decoded item came


def test_which_prompts_are_handed_off() -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0)
    assert eligible(EngineRequest("a", PROMPT, greedy), 16, 4)
    assert not eligible(EngineRequest("a", PROMPT[:63], greedy), 16, 4)  # 3 full blocks
    assert not eligible(EngineRequest("a", PROMPT, greedy, n=2), 16, 4)
    one = SamplingParams(max_tokens=1, temperature=0)
    assert not eligible(EngineRequest("a", PROMPT, one), 16, 4)
    seeded = SamplingParams(max_tokens=8, temperature=0.7, seed=1)
    assert not eligible(EngineRequest("a", PROMPT, seeded), 16, 4)
    req = prefill_request(EngineRequest("a", PROMPT, SamplingParams(max_tokens=8, min_tokens=4)))
    assert (req.sampling.max_tokens, req.sampling.min_tokens, req.handoff) == (1, 1, True)


def test_disaggregation_needs_the_routed_layout_and_kv_sharing() -> None:
    with pytest.raises(ValidationError, match="layout: routed"):
        AppArgs.model_validate({"layout": "direct", "disaggregation": {"enabled": True}})
    with pytest.raises(ValidationError, match="kv_sharing.enabled"):
        AppArgs.model_validate(
            {"disaggregation": {"enabled": True}, "kv_sharing": {"enabled": False}}
        )
    with pytest.raises(ValidationError, match="tbt_slo_ms"):
        AppArgs.model_validate({"disaggregation": {"enabled": True, "tbt_slo_ms": 0}})
    with pytest.raises(ValidationError, match="prefill_replicas"):
        AppArgs.model_validate({"disaggregation": {"enabled": True, "prefill_replicas": 0}})
    assert not AppArgs().disaggregation.enabled


def test_prefill_replicas_take_cpus_from_the_top() -> None:
    assert engine_cpus(0, 1, range(4), 4) == {0}
    assert engine_cpus(0, 1, range(4), 4, from_top=True) == {3}
    assert engine_cpus(1, 2, range(4), 4, from_top=True) == {0, 1}
