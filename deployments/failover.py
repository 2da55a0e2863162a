"""Resuming a stream on another engine replica when the one serving it dies mid-way.

Only where the process holding the client's socket outlives the engine replica: the routed
layout, whose ingress relays items from Engine replicas through a handle. In the direct layout
the replica that dies is the one writing the response, and the stream dies with it.

A prompt's stream that fails with a retryable error (``generation.RetryableError``: its
replica died or its call ended early) after items went out is resumed choice by choice: each
unfinished choice becomes an engine request of its own (``n == 1``) whose prompt is the original
prompt followed by the tokens the client already has, ``max_tokens`` and ``min_tokens`` reduced by
their count. Its block hashes cover that whole sequence, so the new replica imports whatever KV
the dead one published (``deployments.kv_sharing``) and recomputes the rest.

The seam: the new replica's text for the resumed tokens is not used. The ingress replays the
tokens already sent through its own ``IncrementalDetokenizer`` (the engine's class, the same
tokenizer and stop strings), which recreates the dead replica's detokenizer as it stood after the
last item sent, held-back characters (a possible stop string's start, a character whose bytes
were incomplete) included; the new tokens then extend it. So the client's text is exactly an
undisturbed run's, and a stop string that straddles the seam still ends the choice. Counts in
the resumed items are the original request's: its prompt and cached tokens, and every completion
token of the choice.

What cannot be resumed (``resume_blocker``) ends with the error event as before:

* seeded sampling (``seed`` with ``temperature > 0``): the engine draws a seeded request's noise
  from a generator seeded once and advanced by every token; another replica cannot start it at
  the position the dead one reached, so the resumed tokens would not be the seed's.
* ``frequency_penalty`` / ``presence_penalty``: they count output tokens only, and the tokens
  already sent would be the resumed request's prompt. (``repetition_penalty`` covers prompt and
  output alike, so it carries over.)
* structured output: the grammar's state after the tokens sent is not carried.

Unseeded sampling is resumed: the new replica samples each next token from the same
distribution given the same tokens, so the output is a sample of the same law.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.choices import choice_params, merge_streams
from deployments.engine_request import EngineError, EngineRequest, StreamItem
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

# Resumptions of one prompt's stream; a stream that fails again after these ends with an error.
MAX_RESUMES = 2


def resume_blocker(params: SamplingParams) -> str | None:
    """Why a request with ``params`` cannot be resumed on another replica (None: it can)."""
    if params.seed is not None and params.temperature > 0:
        return "seeded sampling cannot continue another replica's random generator"
    if params.frequency_penalty or params.presence_penalty:
        return "frequency/presence penalties count output tokens a resumed request would not see"
    if params.structured_outputs is not None:
        return "structured output's grammar state is not carried to another replica"
    return None


@dataclass
class ChoiceProgress:
    """One choice's output as it went to the client: every token, the text, whether it ended,
    and the original request's counts (from its first item)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    remote_cached_tokens: int = 0


class PromptProgress:
    """What one prompt's choices (``request.n`` of them, the response's choices ``offset + k``)
    sent so far, fed with every item the client gets, original or resumed.

    ``resumes``: resumptions after a stream that had delivered items failed (bounded by
    ``MAX_RESUMES``); ``reopens``: resumptions after a resumed stream failed before delivering
    any (it met a replica already dead or full; bounded like first attempts). ``opened`` numbers
    the resumed requests' ids."""

    def __init__(self, request: EngineRequest, offset: int) -> None:
        self.request = request
        self.offset = offset
        self.choices = [ChoiceProgress() for _ in range(request.n)]
        self.resumes = 0
        self.reopens = 0

    @property
    def opened(self) -> int:
        return self.resumes + self.reopens

    def observe(self, item: StreamItem) -> None:
        choice = self.choices[item.index - self.offset]
        if choice.prompt_tokens is None:
            choice.prompt_tokens = item.prompt_tokens
            choice.cached_tokens = item.cached_tokens
            choice.remote_cached_tokens = item.remote_cached_tokens
        choice.token_ids.extend(item.token_ids)
        choice.text += item.text
        choice.finished = choice.finished or item.finished

    def unfinished(self) -> list[int]:
        return [k for k, c in enumerate(self.choices) if not c.finished]


def resume_request(
    original: EngineRequest,
    k: int,
    choice: ChoiceProgress,
    resume: int,
    block_hashes: Callable[[list[int]], list[int]],
) -> EngineRequest:
    """Choice ``k`` of ``original`` continued after the tokens in ``choice``, as resumption
    number ``resume`` (from 1). ``block_hashes`` hashes a prompt as the original's were.

    Its own request id (``<id>-resume<r>``, ``-<k>`` added for ``n > 1``): a replica may still
    hold the original. No deadline: the first token was served. Prompt logprobs were sent with
    the first item, so they are not asked again."""
    prompt = original.prompt_token_ids + choice.token_ids
    sent = len(choice.token_ids)
    params = choice_params(original.sampling, k)
    params = dataclasses.replace(
        params,
        max_tokens=params.max_tokens - sent,
        min_tokens=max(0, params.min_tokens - sent),
        prompt_logprobs=None,
    )
    rid = f"{original.request_id}-resume{resume}"
    return dataclasses.replace(
        original,
        request_id=rid if original.n == 1 else f"{rid}-{k}",
        prompt_token_ids=prompt,
        sampling=params,
        block_hashes=block_hashes(prompt),
        deadline_ms=None,
        n=1,
    )


class SeamDetokenizer:
    """Choice ``k``'s items from a resumed request, as the original request would have sent
    them: text from the ingress's replay of every token (see the module docstring), the choice's
    index ``k`` within its prompt, the original's counts, and its end where a stop string ends
    it.

    Invariant: ``detok`` has seen exactly the choice's tokens so far, and its ``emitted`` is the
    length of the text the client has."""

    def __init__(
        self,
        tokenizer: Any,
        original: EngineRequest,
        k: int,
        choice: ChoiceProgress,
    ) -> None:
        params = original.sampling
        self.index = k
        self.min_tokens = params.min_tokens
        self.prompt_tokens = (
            choice.prompt_tokens
            if choice.prompt_tokens is not None
            else len(original.prompt_token_ids)
        )
        self.cached_tokens = choice.cached_tokens
        self.remote_cached_tokens = choice.remote_cached_tokens
        self.detok = IncrementalDetokenizer(
            tokenizer,
            params.skip_special_tokens,
            params.stop_strings,
            params.include_stop_str_in_output,
            prompt_token_ids=original.prompt_token_ids,
        )
        self.count = 0
        for token in choice.token_ids:
            self._append(token)
        if not self.detok.text.startswith(choice.text):
            raise ValueError(f"choice {k}: the replayed text does not extend the text sent")
        self.detok.emitted = len(choice.text)

    def _append(self, token: int) -> str | None:
        self.count += 1
        return self.detok.append(token, self.count >= self.min_tokens)

    def adjust(self, item: StreamItem) -> StreamItem:
        """The item as the client gets it (``done`` is the caller's to set)."""
        tokens: list[int] = []
        stop = None
        for token in item.token_ids:
            tokens.append(token)
            stop = self._append(token)
            if stop is not None:
                break
        finished = item.finished or stop is not None
        logprobs = item.logprobs[: len(tokens)] if item.logprobs else item.logprobs
        return dataclasses.replace(
            item,
            index=self.index,
            token_ids=tokens,
            text=self.detok.take_delta(finished),
            finished=finished,
            done=False,
            finish_reason="stop" if stop is not None else item.finish_reason,
            stop_reason=stop if stop is not None else item.stop_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.count,
            cached_tokens=self.cached_tokens,
            remote_cached_tokens=self.remote_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=None,
        )


class ResumedStream:
    """A prompt's stream after a resumption: its unfinished choices' engine streams (one
    request each), merged, their items shaped by each choice's ``SeamDetokenizer`` (indexed
    within the prompt, as an engine stream's items are). The last
    item has ``done``, as an engine stream's does; an ``EngineError`` item or a failure of any
    of them ends it, as it would end an engine stream. ``cancel`` aborts every request."""

    def __init__(self, parts: list[tuple[SeamDetokenizer, Any]]) -> None:
        self.streams = [stream for _, stream in parts]
        # Whether any item came out: a failure before one is a failed open, not a lost stream.
        self.delivered = False
        self.pending = {seam.index for seam, _ in parts}
        self._merged = merge_streams([self._items(seam, stream) for seam, stream in parts])

    @staticmethod
    async def _items(seam: SeamDetokenizer, stream: Any) -> AsyncIterator[Any]:
        while True:
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            if isinstance(item, EngineError):
                yield item
                return
            out = seam.adjust(item)
            yield out
            if out.finished and not item.finished:
                # A stop string across the seam ended the choice; the engine did not know.
                stream.cancel()
                return

    async def __anext__(self) -> StreamItem | EngineError:
        _, item = await self._merged.__anext__()
        self.delivered = True
        if isinstance(item, StreamItem) and item.finished:
            self.pending.discard(item.index)
            item.done = not self.pending
        return item

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()
