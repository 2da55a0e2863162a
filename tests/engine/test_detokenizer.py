"""Incremental detokenization with SmolLM2's tokenizer: deltas, multi-byte characters, stops."""

from __future__ import annotations

from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今日は良い天気ですね。",
    "Party time 🎉🎉 🧑‍🚀 👍🏽 done",
    "naïve café — Ünïcödé «quotes» ∑∫√",
    "def f(x):\n    return x ** 2  # tabs\tand  spaces\n\n",
    "  leading spaces and trailing   ",
]


class SlowTokenizer:
    """Hides ``backend_tokenizer`` so the detokenizer takes its decode-a-window fallback."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed ids until a stop string hits; returns every delta (the last one final) and the stop."""
    deltas, hit = [], None
    for t in ids:
        hit = detok.append(t)
        if hit is not None:
            break
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, hit


@pytest.fixture(params=["fast", "slow"])
def tok(request, smollm2_tokenizer):
    return smollm2_tokenizer if request.param == "fast" else SlowTokenizer(smollm2_tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok, smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    deltas, hit = stream(IncrementalDetokenizer(tok), ids)
    assert hit is None
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_changes_nothing_but_the_start(tok, smollm2_tokenizer, text):
    """With the prompt's last tokens as context, only what the output adds is returned, even when
    the prompt ends inside a multi-byte character."""
    prompt = smollm2_tokenizer.encode("Some context: 🎉", add_special_tokens=False)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas, _ = stream(detok, ids)
    full = smollm2_tokenizer.decode(prompt + ids)
    assert "".join(deltas) == full[len(smollm2_tokenizer.decode(prompt)) :] == text


def test_multibyte_characters_are_split_across_tokens(smollm2_tokenizer):
    """The texts above really exercise the buffering: some tokens carry partial characters."""
    partial = 0
    for text in TEXTS[1:3]:
        for t in smollm2_tokenizer.encode(text, add_special_tokens=False):
            partial += "\ufffd" in smollm2_tokenizer.decode([t])
    assert partial > 0


def test_special_tokens_are_skipped_or_kept(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    skipped, _ = stream(IncrementalDetokenizer(smollm2_tokenizer), ids)
    assert "".join(skipped) == "user\nhi"
    kept, _ = stream(IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=False), ids)
    assert "".join(kept) == "<|im_start|>user\nhi<|im_end|>"


STOP_TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("stop", ["n fox j", "quick", "dog.", "o"])
def test_stop_string_is_found_and_never_shown(tok, smollm2_tokenizer, stop):
    ids = smollm2_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=[stop, "never-there"])
    deltas, hit = stream(detok, ids)
    assert hit == stop
    expected = STOP_TEXT[: STOP_TEXT.index(stop)]
    assert "".join(deltas) == detok.text == expected
    # Nothing emitted before the stop was found reached into the stop string.
    shown = ""
    for d in deltas[:-1]:
        shown += d
        assert expected.startswith(shown)


def test_stop_string_spanning_tokens_is_detected_at_the_completing_token(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    pieces = [smollm2_tokenizer.decode([t]) for t in ids]
    assert not any("n fox j" in p for p in pieces)  # no single token holds it
    detok = IncrementalDetokenizer(smollm2_tokenizer, stop=["n fox j"])
    hits = [detok.append(t) for t in ids[: ids.index(smollm2_tokenizer.encode(" jumps")[0]) + 1]]
    assert hits[-1] == "n fox j" and all(h is None for h in hits[:-1])


def test_include_stop_str_in_output(tok, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["n fox j"], include_stop_str_in_output=True)
    deltas, hit = stream(detok, ids)
    assert hit == "n fox j"
    assert "".join(deltas) == "The quick brown fox j"


def test_earliest_stop_string_wins(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer, stop=["jumps over", "fox"])
    deltas, hit = stream(detok, ids)
    assert hit == "fox"
    assert "".join(deltas) == "The quick brown "


def test_hold_back_is_released_at_finish(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer, stop=["xyzzy"])
    shown = ""
    for t in ids:
        assert detok.append(t) is None
        shown += detok.take_delta(finished=False)
        # Up to len("xyzzy") - 1 characters are held back while the request runs.
        assert len(detok.text) - len(shown) <= 4
        assert detok.text.startswith(shown)
    assert shown == STOP_TEXT[:-4]
    assert shown + detok.take_delta(finished=True) == STOP_TEXT
    assert detok.take_delta(finished=True) == ""


def test_stop_strings_are_not_looked_for_before_min_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer, stop=["quick"])
    hits = [detok.append(t, check_stop=False) for t in ids]
    assert hits == [None] * len(ids)
    assert detok.text == STOP_TEXT


def test_no_tokenizer_means_no_text():
    detok = IncrementalDetokenizer(None, stop=["a"])
    assert detok.append(5) is None
    assert detok.text == "" and detok.take_delta(finished=True) == ""
