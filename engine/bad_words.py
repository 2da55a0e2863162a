"""vLLM's ``bad_words``: words the output must not contain, as token sequences.

A word is tokenized as it would start the text and, where that tokenizes differently, as it would
follow a space (``" word"``: most BPE vocabularies have both forms). A sequence of one token is
never sampled; a longer one is cut off at its last token: that token cannot be sampled right
after the output ends with the rest of the sequence. Only the output is matched, as vLLM
matches it, so a prompt that ends with the start of a bad word does not ban its end.

Invariant: ``word_token_ids`` is computed once per request (``LLMEngine.make_request``) and never
changes; ``banned_tokens`` reads the request's output tokens as they are at each step, so it
needs no state to keep in step with preemption.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

WordTokens = tuple[tuple[int, ...], ...]


def word_token_ids(tokenizer: Any, words: Iterable[str]) -> WordTokens:
    """Each word's token sequences: as it starts the text, and after a space where that differs
    (another first token, the same length)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def banned_tokens(words: WordTokens, output: Sequence[int]) -> list[int]:
    """The tokens the next step may not sample after ``output``."""
    banned = []
    for seq in words:
        head = len(seq) - 1
        if head > len(output):
            continue
        if head == 0 or tuple(output[len(output) - head :]) == seq[:-1]:
            banned.append(seq[-1])
    return banned
