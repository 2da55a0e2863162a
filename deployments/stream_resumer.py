"""Keeping a prompt's started stream going when the engine replica serving it fails.

``StreamResumer`` reads a prompt's next item and, when the read fails in a way another replica
may not (a ``RetryableError``), opens the prompt's unfinished choices again on another replica
from the tokens the client already has. ``deployments.failover`` builds those requests and
stitches their text; this module decides whether to resume and opens the streams.

Invariants:

* a prompt's stream is resumed at most ``failover.MAX_RESUMES`` times; a resumed stream that
  fails before delivering any item is opened again without counting as a resumption, at most
  ``backend.max_attempts - 1`` times in all;
* a backend with a single attempt (the engine in the serving process) is never resumed;
* when the stream cannot be resumed, every stream already opened for it is cancelled and the
  failure's own HTTP error is raised, so the caller ends the response as it would have without
  resumption;
* ``lease.streams[i]`` always holds the stream the prompt is read from: the failed one is
  cancelled and replaced before the next read.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.admission import Admission, Lease
from deployments.engine_backend import EngineBackend, EngineStream, RetryableError
from deployments.engine_request import EngineRequest, StreamItem
from deployments.failover import (
    MAX_RESUMES,
    PromptProgress,
    ResumedStream,
    SeamDetokenizer,
    resume_blocker,
    resume_request,
)

logger = logging.getLogger("ray.serve")

# The next item of a stream, its choice indexes moved up by an offset (``Generation._next_item``).
ItemReader = Callable[[Any, int], Awaitable[StreamItem]]
# Block hashes of a prompt as a given request's were computed (``Generation._hasher``).
HasherFor = Callable[[EngineRequest], Callable[[list[int]], list[int]]]


class StreamResumer:
    """Resumes the failed streams of one ``Generation`` on its ``backend``; failovers are counted
    in ``admission``'s metrics."""

    def __init__(
        self,
        backend: EngineBackend,
        admission: Admission,
        next_item: ItemReader,
        hasher: HasherFor,
    ) -> None:
        self.backend = backend
        self.admission = admission
        self.next_item = next_item
        self.hasher = hasher

    async def next_or_resume(
        self, lease: Lease, i: int, progress: PromptProgress, tokenizer: Any
    ) -> StreamItem:
        """Prompt ``i``'s next item; its stream resumed on another replica when it fails in a
        way another replica may not (see ``deployments.failover``)."""
        while True:
            try:
                return await self.next_item(lease.streams[i], progress.offset)
            except RetryableError as e:
                lease.streams[i].cancel()
                lease.streams[i] = self.resume(e, lease, i, progress, tokenizer)

    def resume(
        self,
        error: RetryableError,
        lease: Lease,
        i: int,
        progress: PromptProgress,
        tokenizer: Any,
    ) -> ResumedStream:
        """Prompt ``i``'s unfinished choices, each opened again after the tokens it sent;
        raises ``error``'s HTTP error when the stream cannot be resumed."""
        original = progress.request
        failed = lease.streams[i]
        # A resumed stream that failed before any item met a dead or full replica: open again,
        # as a first attempt would be, without counting a failover.
        reopen = isinstance(failed, ResumedStream) and not failed.delivered
        why = resume_blocker(original.sampling)
        if self.backend.max_attempts <= 1:
            why = "the engine runs in the process that serves the stream"
        elif not reopen and progress.resumes >= MAX_RESUMES:
            why = f"resumed {progress.resumes} times already"
        elif reopen and progress.reopens + 1 >= self.backend.max_attempts:
            why = f"{progress.reopens + 1} resumed requests failed before any output"
        parts: list[tuple[SeamDetokenizer, EngineStream]] = []
        if why is None:
            if reopen:
                progress.reopens += 1
            else:
                progress.resumes += 1
            hasher = self.hasher(original)
            try:
                for k in progress.unfinished():
                    choice = progress.choices[k]
                    req = resume_request(original, k, choice, progress.opened, hasher)
                    seam = SeamDetokenizer(tokenizer, original, k, choice)
                    key = f"{i}-resume{progress.opened}-{k}"
                    parts.append((seam, self.backend.open(req, i, len(lease.streams), key)))
            except ValueError as e:
                why = str(e)
        if why is not None:
            for _, stream in parts:
                stream.cancel()
            logger.warning("engine stream failed after output, not resumed (%s): %s", why, error)
            raise error.error from error
        if not reopen:
            self.admission.metrics.failovers.inc(len(parts))
        logger.warning(
            "engine stream failed after output (%s): %s %d choice(s) on another replica "
            "(failover %d of at most %d)",
            error,
            "opening again" if reopen else "resuming",
            len(parts),
            progress.resumes,
            MAX_RESUMES,
        )
        return ResumedStream(parts)
