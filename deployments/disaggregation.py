"""Prefill/decode disaggregation: a prompt computed on a Prefill replica, decoded on an Engine one.

A planned resumption (``deployments.failover``): the ingress opens an eligible prompt on the
Prefill deployment with ``max_tokens`` 1 and ``EngineRequest.handoff`` set. That replica computes
the prompt, publishes its full blocks to the KV directory and waits until the directory holds
them before it sends its last item, the first token, which goes to the client at once. The
ingress then continues the choice on the Engine deployment (the decode side) exactly as failover
resumes one: the prompt followed by that token, ``max_tokens`` and ``min_tokens`` reduced by
one, so the decode replica imports the handed-off blocks and recomputes only the partial last
block. The client's text comes from one ``SeamDetokenizer`` on the ingress, fed the prefill's
token and then the decode side's, so it is exactly a colocated run's (held-back characters and
stop strings across the seam included).

Eligible (``eligible``): one choice (``n == 1``), more than one token to generate, sampling that
failover can resume (``failover.resume_blocker``), and at least ``kv_sharing.min_blocks`` full
prompt blocks (fewer would not be imported anyway). Everything else runs on the Engine
deployment as without disaggregation. Faults are the existing paths: a prefill replica lost
before its item is retried (``generation``), then run colocated on the Engine deployment; a
decode replica lost is a failover; a decode replica that refuses (429) is tried again on
another, and the stream ends with the 429 as an error event when none has room.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from deployments.admission import Lease, read_to_end
from deployments.engine_backend import EngineBackend
from deployments.engine_request import EngineError, EngineRequest, StreamItem
from deployments.failover import (
    ChoiceProgress,
    ResumedStream,
    SeamDetokenizer,
    resume_blocker,
    resume_request,
)
from deployments.http_errors import HTTPError
from router.slo import VERDICTS

logger = logging.getLogger("ray.serve")

# Outcomes of an eligible prompt, the label of ``prefixserve_handoffs``.
HANDED_OFF = "handed_off"  # decoded on the Engine deployment
ENDED_AT_PREFILL = "ended_at_prefill"  # the first token ended the choice (EOS, stop)
COLOCATED = "colocated_fallback"  # no prefill replica could serve it: run on the Engine side


def eligible(req: EngineRequest, block_size: int, min_blocks: int) -> bool:
    """Whether ``req`` is prefilled on the Prefill deployment and handed off."""
    return (
        req.n == 1
        and req.sampling.max_tokens > 1
        and resume_blocker(req.sampling) is None
        and len(req.prompt_token_ids) // block_size >= min_blocks
    )


def prefill_request(req: EngineRequest) -> EngineRequest:
    """``req`` as the Prefill deployment runs it: its first token only, KV handed off."""
    params = dataclasses.replace(
        req.sampling, max_tokens=1, min_tokens=min(req.sampling.min_tokens, 1)
    )
    # Streamed whatever the client asked: the single item goes out as soon as it is ready.
    return dataclasses.replace(req, sampling=params, handoff=True, stream=True)


@dataclass
class Handoff:
    """The prefill's item as the client gets it (``first``: index within the prompt, ``done``
    when the choice ended there), and the decode side's request (None then). ``seam`` has seen
    the first token and shapes the decode side's items."""

    first: StreamItem
    seam: SeamDetokenizer
    decode: EngineRequest | None


def hand_off(
    tokenizer: object,
    original: EngineRequest,
    item: StreamItem,
    block_hashes: Callable[[list[int]], list[int]],
) -> Handoff:
    """What follows the prefill replica's last ``item`` for ``original`` (eligible)."""
    counts = ChoiceProgress(
        prompt_tokens=item.prompt_tokens,
        cached_tokens=item.cached_tokens,
        remote_cached_tokens=item.remote_cached_tokens,
    )
    seam = SeamDetokenizer(tokenizer, original, 0, counts)
    # "length" is the prefill's own max_tokens of 1, not the client's: the choice goes on, and
    # its text so far is what a colocated run would have sent (nothing flushed early).
    goes_on = item.finish_reason == "length"
    if goes_on:
        item = dataclasses.replace(
            item, finished=False, done=False, finish_reason=None, stop_reason=None
        )
    first = seam.adjust(item)
    if first.finished:
        first.done = True
        return Handoff(first, seam, None)
    sent = dataclasses.replace(counts, token_ids=list(first.token_ids), text=first.text)
    decode = resume_request(original, 0, sent, 0, block_hashes)
    return Handoff(
        first, seam, dataclasses.replace(decode, request_id=f"{original.request_id}-decode")
    )


class DecodeStream(ResumedStream):
    """The decode side's stream of a handed-off choice; ``on_first`` runs when its first item
    arrives (the time from the prefill's last item to the first decoded token)."""

    def __init__(self, seam: SeamDetokenizer, stream: object, on_first: Callable[[], None]) -> None:
        super().__init__([(seam, stream)])
        self._on_first: Callable[[], None] | None = on_first

    async def __anext__(self) -> StreamItem | EngineError:
        item = await super().__anext__()
        if self._on_first is not None and isinstance(item, StreamItem):
            self._on_first()
            self._on_first = None
        return item


class HandoffMetrics:
    """The ingress's handoff figures, in its metrics registry (labelled by ``ingress``)."""

    def __init__(self, registry: CollectorRegistry, ingress_id: str) -> None:
        labels = {"ingress": ingress_id}
        self.outcomes = Counter(
            "prefixserve_handoffs",
            "Eligible prompts under prefill/decode disaggregation, by outcome: handed_off "
            "(decoded on the Engine deployment), ended_at_prefill (the first token ended the "
            "choice), colocated_fallback (no prefill replica served it).",
            ["ingress", "outcome"],
            registry=registry,
        )
        for outcome in (HANDED_OFF, ENDED_AT_PREFILL, COLOCATED):
            self.outcomes.labels(outcome=outcome, **labels)
        self.blocks = Counter(
            "prefixserve_handoff_blocks",
            "Prompt KV blocks the prefill replicas published for the decode side.",
            ["ingress"],
            registry=registry,
        ).labels(**labels)
        self.bytes = Counter(
            "prefixserve_handoff_bytes",
            "Bytes of the prompt KV blocks handed off.",
            ["ingress"],
            registry=registry,
        ).labels(**labels)
        self.publish_seconds = Histogram(
            "prefixserve_handoff_publish_seconds",
            "Seconds a prefill replica spent publishing a prompt's blocks before its last item.",
            ["ingress"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        ).labels(**labels)
        self.tbt_slo_misses = Counter(
            "prefixserve_tbt_slo_misses",
            "Handed-off prompts decoded on a replica predicted to exceed the inter-token SLO "
            "(disaggregation.tbt_slo_ms) with them: no decode replica was predicted to keep it.",
            ["ingress"],
            registry=registry,
        ).labels(**labels)
        self.first_token_seconds = Histogram(
            "prefixserve_handoff_first_token_seconds",
            "Seconds from the prefill replica's last item to the first decoded token's item.",
            ["ingress"],
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        ).labels(**labels)
        self._labels = labels

    def outcome(self, outcome: str) -> None:
        self.outcomes.labels(outcome=outcome, **self._labels).inc()

    def handed_off(self, item: StreamItem, decode_id: str) -> Callable[[], None]:
        """Count the handoff reported by the prefill's last ``item``; returns the callback that
        observes the wait for the first decoded token and, then, whether the decode side's
        request ``decode_id`` was routed within its inter-token SLO (``router.slo``)."""
        self.outcome(HANDED_OFF)
        self.blocks.inc(item.handoff_blocks)
        self.bytes.inc(item.handoff_bytes)
        self.publish_seconds.observe(item.handoff_s)
        started = time.perf_counter()

        def on_first() -> None:
            self.first_token_seconds.observe(time.perf_counter() - started)
            if VERDICTS.take(decode_id) is False:
                self.tbt_slo_misses.inc()

        return on_first


class PrefillFirst:
    """The ingress side of disaggregation: which prompts go to the ``prefill`` backend first
    (``eligible``), and the handoff of their streams to the ``decode`` backend."""

    def __init__(
        self,
        prefill: EngineBackend,
        decode: EngineBackend,
        metrics: HandoffMetrics,
        block_size: int,
        min_blocks: int,
        tbt_slo_ms: float | None = None,
    ) -> None:
        """``tbt_slo_ms``: the inter-token SLO the decode side's requests carry (None: none)."""
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.block_size = block_size
        self.min_blocks = min_blocks
        self.tbt_slo_ms = tbt_slo_ms
        # Prefill streams read to their end after the handoff (held: the loop keeps weak refs).
        self._draining: set[asyncio.Task[None]] = set()

    def applies(self, req: EngineRequest) -> bool:
        return eligible(req, self.block_size, self.min_blocks)

    async def open(
        self,
        lease: Lease,
        i: int,
        n: int,
        req: EngineRequest,
        tokenizer: Any,
        attempt: Callable[[EngineRequest, EngineBackend], Awaitable[StreamItem]],
        block_hashes: Callable[[list[int]], list[int]],
    ) -> StreamItem:
        """Prompt ``i``'s first item from a prefill replica (``attempt`` runs a request on a
        backend, retrying as the ingress does); ``lease.streams[i]`` then continues on the
        decode side. Where no prefill replica serves it, it runs on the decode side whole."""
        try:
            item = await attempt(prefill_request(req), self.prefill)
        except HTTPError as e:
            if e.code not in ("engine_unavailable", "overloaded"):
                raise
            logger.warning("no prefill replica served the prompt (%s): running it colocated", e)
            self.metrics.outcome(COLOCATED)
            return await attempt(req, self.decode)
        handoff = hand_off(tokenizer, req, item, block_hashes)
        handoff.first.index += i * n
        if handoff.decode is None:
            self.metrics.outcome(ENDED_AT_PREFILL)
            return handoff.first
        decode_req = dataclasses.replace(handoff.decode, tbt_slo_ms=self.tbt_slo_ms)
        on_first = self.metrics.handed_off(item, decode_req.request_id)
        drain = asyncio.get_running_loop().create_task(read_to_end(lease.streams[i]))
        self._draining.add(drain)
        drain.add_done_callback(self._draining.discard)
        decode = self.decode.open(decode_req, i, len(lease.streams), key=f"{i}-decode")
        lease.streams[i] = DecodeStream(handoff.seam, decode, on_first)
        return handoff.first
