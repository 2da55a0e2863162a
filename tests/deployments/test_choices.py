"""Several choices of one request, without a cluster: their seeds, the merged stream, and the
OpenAI bodies built from interleaved items."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deployments.choices import choice_params, merge_streams
from deployments.engine_request import StreamItem
from deployments.openai_format import Echo, ResponseBuilder
from engine.sampling_params import SamplingParams


def test_choice_seeds_differ_and_unseeded_choices_share_params():
    seeded = SamplingParams(seed=7, temperature=0.8)
    assert [choice_params(seeded, k).seed for k in range(3)] == [7, 8, 9]
    assert choice_params(seeded, 2).temperature == 0.8
    assert seeded.seed == 7  # not modified
    unseeded = SamplingParams()
    assert choice_params(unseeded, 3) is unseeded


class Source:
    """An async stream that yields its items with pauses, and records whether it was closed."""

    def __init__(self, items: list[Any], delay: float, fail: Exception | None = None) -> None:
        self.items, self.delay, self.fail = items, delay, fail
        self.closed = False

    async def run(self) -> AsyncIterator[Any]:
        try:
            for item in self.items:
                await asyncio.sleep(self.delay)
                yield item
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True


async def collect(stream: AsyncIterator[Any], limit: int | None = None) -> list[Any]:
    out = []
    async for x in stream:
        out.append(x)
        if limit is not None and len(out) == limit:
            break
    return out


def test_merge_interleaves_every_item_and_ends_after_the_last_stream():
    fast, slow = Source(["a1", "a2", "a3"], 0.001), Source(["b1", "b2"], 0.02)
    out = asyncio.run(collect(merge_streams([fast.run(), slow.run()])))
    assert sorted(out) == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1"), (1, "b2")]
    assert out[:3] == [(0, "a1"), (0, "a2"), (0, "a3")]  # in arrival order, not by stream
    assert [x for k, x in out if k == 1] == ["b1", "b2"]
    assert fast.closed and slow.closed


def test_leaving_early_closes_every_stream():
    sources = [Source(list(range(100)), 0.001) for _ in range(3)]

    async def run() -> tuple[list[Any], bool]:
        merged = merge_streams([s.run() for s in sources])
        out = await collect(merged, limit=4)
        await merged.aclose()
        return out, all(s.closed for s in sources)

    out, closed = asyncio.run(run())
    assert len(out) == 4 and closed


def test_an_error_in_one_stream_ends_the_merge_and_closes_the_others():
    broken = Source(["x"], 0.001, fail=ValueError("prompt: bad"))
    other = Source(list(range(100)), 0.01)

    async def run() -> bool:
        merged = merge_streams([broken.run(), other.run()])
        with pytest.raises(ValueError, match="prompt: bad"):
            await collect(merged)
        return other.closed

    assert asyncio.run(run())


def test_a_single_stream_passes_straight_through_and_is_closed_when_left():
    source = Source(["only"], 0.0)
    assert asyncio.run(collect(merge_streams([source.run()]))) == [(0, "only")]
    left = Source(["a", "b", "c"], 0.0)

    async def run() -> tuple[list[Any], bool]:
        merged = merge_streams([left.run()])
        out = await collect(merged, limit=1)
        await merged.aclose()
        return out, left.closed  # before asyncio.run closes leftover generators itself

    assert asyncio.run(run()) == ([(0, "a")], True)


def item(index: int, text: str, completion: int, finished: bool = False, **extra) -> StreamItem:
    return StreamItem(
        replica_id="r1",
        index=index,
        token_ids=[],
        text=text,
        finished=finished,
        done=finished,
        finish_reason="length" if finished else None,
        stop_reason=None,
        prompt_tokens=5,
        completion_tokens=completion,
        cached_tokens=4 - index,
        logprobs=extra.get("logprobs"),
        prompt_logprobs=extra.get("prompt_logprobs"),
    )


INTERLEAVED = [
    item(1, "Hel", 1, logprobs=[(10, -0.5, [])]),
    item(0, "A", 1, logprobs=[(11, -0.1, [])]),
    item(1, "lo", 2, finished=True, logprobs=[(12, -0.2, [])]),
    item(0, "B", 3, finished=True, logprobs=[(13, -0.3, []), (14, -0.4, [])]),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_full_response_has_one_choice_per_index_and_summed_usage(kind):
    builder = ResponseBuilder(kind, "id-1", "tiny", None, n=2)
    body = builder.full(INTERLEAVED)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    texts = [c["message"]["content"] if kind == "chat" else c["text"] for c in choices]
    assert texts == ["AB", "Hello"]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert body["usage"]["prompt_tokens"] == 5  # once, not per choice
    assert body["usage"]["completion_tokens"] == 3 + 2
    assert body["usage"]["total_tokens"] == 10
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    if kind == "completion":
        # Text offsets count within each choice.
        assert choices[0]["logprobs"]["text_offset"] == [0, 4, 8]
        assert choices[1]["logprobs"]["text_offset"] == [0, 4]


def test_streamed_chunks_carry_their_index_and_usage_sums_the_choices():
    builder = ResponseBuilder("chat", "id-2", "tiny", None, n=2)
    assert [builder.role_chunk(k)["choices"][0]["index"] for k in range(2)] == [0, 1]
    chunks = [builder.chunk(i) for i in INTERLEAVED]
    assert [c["choices"][0]["index"] for c in chunks] == [1, 0, 1, 0]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length", "length"]
    usage = builder.usage_chunk()["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] == 5


def test_several_prompts_count_each_prompt_once_and_keep_their_cached_tokens():
    # Two prompts x n=2: choices 0-1 belong to prompt 0, 2-3 to prompt 1.
    items = [item(3, "d", 1, True), item(0, "a", 1, True), item(2, "c", 2, True)]
    items.append(item(1, "b", 1, True))
    items[0].prompt_tokens = items[2].prompt_tokens = 7
    body = ResponseBuilder("completion", "id-3", "tiny", None, n=2, num_prompts=2).full(items)
    assert [c["text"] for c in body["choices"]] == ["a", "b", "c", "d"]
    assert body["usage"]["prompt_tokens"] == 5 + 7
    assert body["usage"]["completion_tokens"] == 5
    # cached_tokens: choice 0's (4) for prompt 0, choice 2's (2) for prompt 1.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 + 2


SCORED = [None, (21, -1.5, [(30, -0.5)]), (22, -2.5, [(22, -2.5)])]


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion():
    echo = [Echo("<20><21><22>", [20, 21, 22])]
    first = item(0, "X", 1, logprobs=[(40, -0.25, [(40, -0.25)])], prompt_logprobs=SCORED)
    last = item(0, "Y", 2, finished=True, logprobs=[(41, -0.75, [(41, -0.75)])])
    body = ResponseBuilder("completion", "id-4", "tiny", None, echo=echo).full([first, last])
    [choice] = body["choices"]
    assert choice["text"] == "<20><21><22>XY"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<20>", "<21>", "<22>", "<40>", "<41>"]
    assert lp["token_logprobs"] == [None, -1.5, -2.5, -0.25, -0.75]
    assert lp["top_logprobs"] == [
        None,
        {"<30>": -0.5},
        {"<22>": -2.5},
        {"<40>": -0.25},
        {"<41>": -0.75},
    ]
    assert lp["text_offset"] == [0, 4, 8, 12, 16]

    streamed = ResponseBuilder("completion", "id-5", "tiny", None, echo=echo)
    chunks = [streamed.chunk(i)["choices"][0] for i in (first, last)]
    assert [c["text"] for c in chunks] == ["<20><21><22>X", "Y"]
    assert chunks[0]["logprobs"]["token_logprobs"] == [None, -1.5, -2.5, -0.25]
    assert chunks[1]["logprobs"]["text_offset"] == [16]


def test_echo_only_scores_the_prompt_and_drops_the_generated_token():
    echo = [Echo("ab", [20, 21, 22]), Echo("cd", [23, 24])]
    items = [
        item(1, "Q", 1, True, logprobs=[(50, -0.1, [])], prompt_logprobs=[None, (24, -3.0, [])]),
        item(0, "P", 1, True, logprobs=[(51, -0.1, [])], prompt_logprobs=SCORED),
    ]
    items[1].finish_reason = "stop"  # an EOS as the one generated token: still "length"
    builder = ResponseBuilder(
        "completion", "id-6", "tiny", None, num_prompts=2, echo=echo, echo_only=True
    )
    assert all(builder.has_content(i) for i in items)
    body = builder.full(items)
    assert [c["text"] for c in body["choices"]] == ["ab", "cd"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["choices"][1]["logprobs"]["token_logprobs"] == [None, -3.0]
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == 10


def test_a_token_with_no_text_yet_still_makes_a_chunk() -> None:
    """A special token (skipped from the text) or half a multi-byte character is still a token:
    its chunk goes out when it is made, so a client's time to first token is the engine's."""
    builder = ResponseBuilder("completion", "cmpl-x", "m", None)
    silent = StreamItem("r", 0, [7], "", False, False, None, None, 3, 1, 0)
    assert builder.has_content(silent)
    assert builder.chunk(silent)["choices"][0]["text"] == ""
    nothing = StreamItem("r", 0, [], "", False, False, None, None, 3, 1, 0)
    assert not builder.has_content(nothing)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_masked_and_nan_logprobs_read_as_finite_json(kind):
    """-inf (a masked token) and NaN become vLLM's -9999.0, so the body is valid JSON."""
    import json

    raw = [(10, float("-inf"), [(11, float("nan")), (12, -0.5)]), (13, -1e6, [])]
    items = [
        StreamItem(
            replica_id="r1",
            index=0,
            token_ids=[10, 13],
            text="ab",
            finished=True,
            done=True,
            finish_reason="length",
            stop_reason=None,
            prompt_tokens=3,
            completion_tokens=2,
            cached_tokens=0,
            logprobs=raw,
        )
    ]
    body = ResponseBuilder(kind, "id", "tiny", None).full(items)
    text = json.dumps(body, allow_nan=False)  # raises on inf/nan
    lp = body["choices"][0]["logprobs"]
    if kind == "chat":
        assert [c["logprob"] for c in lp["content"]] == [-9999.0, -9999.0]
        assert [t["logprob"] for t in lp["content"][0]["top_logprobs"]] == [-9999.0, -0.5]
    else:
        assert lp["token_logprobs"] == [-9999.0, -9999.0]
        assert list(lp["top_logprobs"][0].values()) == [-9999.0, -0.5]
    assert "Infinity" not in text and "NaN" not in text
