"""vLLM's ``bad_words``: the token sequences a word becomes, the tokens banned after an output,
and generation that never completes a bad word, against transformers' ``bad_words_ids``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.bad_words import banned_tokens, word_token_ids
from tests.helpers import hf_greedy

MAX_NEW = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_with_tokenizer: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)


def test_a_word_is_banned_at_the_start_of_the_text_and_after_a_space(tokenizer: Any) -> None:
    bare = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert len(bare) == len(spaced) and bare[0] != spaced[0]  # two forms in this vocabulary
    assert word_token_ids(tokenizer, ["hello"]) == (tuple(bare), tuple(spaced))
    # A word given with its space is the same word.
    assert word_token_ids(tokenizer, [" hello"]) == word_token_ids(tokenizer, ["hello"])
    long = tokenizer.encode("unbelievably", add_special_tokens=False)
    assert word_token_ids(tokenizer, ["unbelievably"])[0] == tuple(long)


def test_the_last_token_is_banned_once_the_rest_was_output() -> None:
    words = ((5,), (7, 8, 9))
    assert banned_tokens(words, []) == [5]
    assert banned_tokens(words, [1, 7]) == [5]
    assert banned_tokens(words, [1, 7, 8]) == [5, 9]
    assert banned_tokens(words, [7, 8, 1]) == [5]


def test_bad_words_must_be_non_blank_strings() -> None:
    for bad in (["ok", ""], ["  "], "word", [3]):
        with pytest.raises(ValueError, match="^bad_words:"):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]


def test_generation_avoids_bad_words_as_transformers_does(
    tiny_llama_with_tokenizer: Path, tokenizer: Any
) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (5, 9, 14)]
    reference = hf_greedy(tiny_llama_with_tokenizer, prompts, MAX_NEW)
    counts: dict[int, int] = {}
    for tokens in reference:
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
    favourites = sorted(counts, key=counts.__getitem__, reverse=True)[:2]
    words = [tokenizer.decode([t]) for t in favourites]
    sequences = word_token_ids(tokenizer, words)
    assert any(seq[-1] in favourites for seq in sequences)
    expected = hf_greedy(
        tiny_llama_with_tokenizer, prompts, MAX_NEW, bad_words_ids=[list(s) for s in sequences]
    )
    assert expected != reference
    llm = LLM(model=str(tiny_llama_with_tokenizer), dtype="float32")
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, min_tokens=MAX_NEW, bad_words=words
    )
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    for out in outs:
        assert not set(out.token_ids) & {s[0] for s in sequences if len(s) == 1}
