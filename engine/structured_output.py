"""Constrained decoding: what a request's output must match, and the grammar state that enforces it.

``StructuredOutputs`` is the request's constraint (one of a JSON schema, any JSON object, a
regular expression, a list of choices or a Lark grammar); it is plain data, so it travels with
``SamplingParams`` to any replica. ``GrammarCompiler`` (one per engine) turns it into an
``llguidance.LLMatcher``: the per-request parser whose token mask the sampler applies and which
advances with every accepted token. The matcher reaching the end of its grammar stops the request.

llguidance is the grammar library (docs/structured_output.md says why): it computes masks on the
CPU from the tokenizer's vocabulary, with no torch dependency of its own.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

# Outputs are compact JSON (no whitespace between tokens): with free whitespace a sampled model
# can spend its whole token budget on blanks and end with an incomplete document.
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the fields is set.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: the output is one of
    these strings; ``grammar``: a Lark grammar (llguidance's dialect)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [
            self.json is not None,
            self.json_object,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
        ]
        if sum(kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar"
            )

    def grammar_text(self) -> str:
        """The llguidance grammar; raises ValueError when it cannot be built or is invalid."""
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("schema must be a JSON object")
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif self.regex is not None:
            text = llguidance.LLMatcher.grammar_from_regex(self.regex)
        elif self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a non-empty list of strings")
            lark = "start: " + " | ".join(json.dumps(c) for c in self.choice)
            text = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            text = llguidance.LLMatcher.grammar_from_lark(self.grammar or "")
        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise ValueError(error.strip().splitlines()[0])
        return text

    def check(self) -> None:
        """Raise ValueError (the library's reason) unless the constraint compiles."""
        self.grammar_text()


class GrammarCompiler:
    """Builds matchers for one tokenizer. Thread-safe: requests are made on the callers'
    threads; the vocabulary is indexed once (~0.3 s for a 49k vocabulary) on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if self._tokenizer is None:
                    raise ValueError("structured_outputs: this model has no tokenizer")
                eos = self._eos or None
                self._ll = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=eos
                )
            return self._ll

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        try:
            text = spec.grammar_text()
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        m = llguidance.LLMatcher(self._ll_tokenizer(), text, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m


def apply_token_masks(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Set to -inf, in place, every token that ``matchers[i]`` does not allow next in row
    ``rows[i]`` of ``logits [S, V]``. Rows not listed are not touched (no cost for them)."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = np.empty((len(rows), words), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
    # Bit j of word w allows token 32 w + j; little-endian words unpack in that order.
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(allowed == 0).to(logits.device)
    # Row by row in place: gathering the rows and scattering them back costs several times more
    # (docs/performance.md, "Figures behind the code").
    for i, row in enumerate(rows):
        logits[row].masked_fill_(banned[i], float("-inf"))
