"""Stop strings: the shared, indexed set finds exactly what scanning every stop string over the
text finds, and a request's sequences share one set instead of copying it."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStrings

# A small alphabet makes overlapping and repeated stop strings likely.
ALPHABET = "ab c\u00e9"
VOCAB = ["a", "b", " ", "c", "\u00e9", "ab", "ba", "a b", "cc", "abc", " \u00e9a"]


class CharTokenizer:
    """Token ``i`` decodes to ``VOCAB[i]``; no ``backend_tokenizer``, so the detokenizer takes
    its decode-a-window path."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)


class ScanningDetokenizer:
    """The reference: every stop string searched over the text that could hold a new one."""

    def __init__(self, stop: list[str], include_stop: bool) -> None:
        self.stop, self.include_stop, self.text = stop, include_stop, ""

    def append(self, piece: str, check_stop: bool) -> str | None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += piece
        if not self.stop or not check_stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s


stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=8)


@settings(max_examples=400, deadline=None)
@given(
    stop=stop_lists,
    tokens=st.lists(st.integers(0, len(VOCAB) - 1), max_size=40),
    min_tokens=st.integers(0, 6),
    include_stop=st.booleans(),
)
def test_indexed_search_matches_scanning_every_stop_string(
    stop: list[str], tokens: list[int], min_tokens: int, include_stop: bool
) -> None:
    detok = IncrementalDetokenizer(
        CharTokenizer(), stop=stop, include_stop_str_in_output=include_stop
    )
    reference = ScanningDetokenizer(stop, include_stop)
    for count, token in enumerate(tokens, start=1):
        check = count >= min_tokens
        hit = detok.append(token, check)
        assert hit == reference.append(VOCAB[token], check)
        assert detok.text == reference.text
        if hit is not None:
            break


def test_the_first_listed_stop_string_wins_a_tie() -> None:
    assert StopStrings(["abc", "ab"]).find("xxabc", 0, 0) == (2, "abc")
    assert StopStrings(["ab", "abc"]).find("xxabc", 0, 0) == (2, "ab")
    # Earlier beats first listed.
    assert StopStrings(["bc", "xa"]).find("xabc", 0, 0) == (0, "xa")


def test_only_the_ends_not_yet_searched_are_looked_at() -> None:
    stop = StopStrings(["ab"])
    assert stop.find("ab--", 0, 2) is None  # "ab" ends at 2: searched already
    assert stop.find("ab--ab", 0, 4) == (4, "ab")
    assert stop.find("--ab", 3, 0) is None  # begins before start


def test_stop_strings_are_validated_and_immutable() -> None:
    for bad in ([""], ["ok", ""], ["ok", 3]):
        with pytest.raises(ValueError, match="^stop:"):
            StopStrings(bad)  # type: ignore[arg-type]
    stop = StopStrings(["x", "yy"])
    with pytest.raises(AttributeError):
        stop.strings = ("z",)  # type: ignore[misc]
    assert stop.max_len == 2 and len(stop) == 2 and list(stop) == ["x", "yy"]
    assert not StopStrings() and StopStrings().max_len == 0


def test_pickling_keeps_the_strings_and_rebuilds_the_index() -> None:
    stop = StopStrings(["de", "cde", "x"])
    copy = pickle.loads(pickle.dumps(stop))
    assert copy == stop and copy is not stop
    assert copy.find("abcde", 0, 0) == stop.find("abcde", 0, 0) == (2, "cde")


def test_a_requests_choices_share_one_stop_set() -> None:
    params = SamplingParams(stop=["###", "END"], stop_token_ids=[5, 7], seed=3)
    choices = [params.with_seed(3 + k) for k in range(4)]
    assert [c.seed for c in choices] == [3, 4, 5, 6]
    assert all(c.stop is params.stop for c in choices)
    assert all(c.stop_token_ids is params.stop_token_ids for c in choices)
    assert all(c.logit_bias is params.logit_bias for c in choices)
    # The detokenizer of each sequence holds the same set too.
    detoks = [IncrementalDetokenizer(CharTokenizer(), stop=c.stop_strings) for c in choices]
    assert all(d.stop is params.stop for d in detoks)
    # Rebuilding parameters from a StopStrings keeps the object.
    assert SamplingParams(stop=params.stop).stop is params.stop
