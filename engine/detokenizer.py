"""Incremental detokenization with stop strings.

``IncrementalDetokenizer`` owns the text of one request's output:

* ``text`` is the decoding of every token appended so far; a multi-byte character whose bytes are
  split across tokens appears only once all its bytes have arrived (the tokenizers library's
  ``DecodeStream`` buffers them), so no delta ever holds half a character.
* ``take_delta()`` returns the text not yet returned, minus a hold-back of
  ``max(len(stop)) - 1`` characters while the request runs: those could be the start of a stop
  string that the next token completes, and a client must never see a stop string.

Stop strings are a ``StopStrings`` shared by every sequence of a request; each token searches only
the text positions it can have completed a stop string at (``_searched`` marks the end of the
text already searched), through the index, not every stop string over the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.stop_strings import StopStrings

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any | None,
        skip_special_tokens: bool = True,
        stop: StopStrings | Iterable[str] | None = None,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = StopStrings.of(stop)
        self.include_stop = include_stop_str_in_output
        self.holdback = max(self.stop.max_len, 1) - 1
        self.text = ""
        self.emitted = 0
        # Stop strings ending at or before this position of ``text`` were searched for already.
        self._searched = 0
        self._stream = None
        # The last prompt tokens give the first generated token its context: SentencePiece
        # tokenizers decode a leading space differently at the start of a text.
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = list(context)
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer else None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(
                ids=context or None, skip_special_tokens=skip_special_tokens
            )
        self._fallback_prefix = 0
        self._fallback_read = len(context)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one generated token. Returns the stop string it completed, if any (``text`` is then
        cut before it, or after it with ``include_stop_str_in_output``). With ``check_stop``
        False (before ``min_tokens``) stop strings are not looked for."""
        if self.tokenizer is None:
            return None
        piece = self._decode_next(token_id)
        if not piece:
            return None
        # A stop string the new piece completes begins at most max_len - 1 characters before it.
        start = max(0, len(self.text) - self.stop.max_len + 1)
        self.text += piece
        if not self.stop or not check_stop:
            return None
        best = self.stop.find(self.text, start, self._searched)
        if best is None:
            self._searched = len(self.text)
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        # Slow tokenizers: decode a small window and emit what grew, waiting out U+FFFD.
        self._ids.append(token_id)
        prefix = self.tokenizer.decode(
            self._ids[self._fallback_prefix : self._fallback_read],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = self.tokenizer.decode(
            self._ids[self._fallback_prefix :], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._fallback_prefix = self._fallback_read
            self._fallback_read = len(self._ids)
            return full[len(prefix) :]
        return ""
