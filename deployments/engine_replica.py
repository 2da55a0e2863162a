"""The engine deployment: each replica runs one AsyncEngine and streams results back.

A replica's lifecycle: load the model, start the engine thread, then every second report health
and metrics to the replica registry (``deployments.replica_report``). Serve polls
``record_routing_stats`` for the request router and ``check_health``. If the engine loop dies, or
stalls in one step for longer than ``engine_stall_timeout_s`` (the engine's watchdog), every live
stream ends with an error item, health checks fail, and the replica takes itself down half a
second later, so that callers fail over at once and Serve starts a replacement.

Admission: a replica holds at most ``capacity`` requests (``max_num_seqs`` running plus
``limits.max_waiting_per_replica`` waiting), counted from the moment ``generate`` starts, so
requests still in transit to the engine thread or importing KV count too. Beyond it the request
gets a 429 item at once. Serve's ``max_ongoing_requests`` on this deployment is set a little above
``capacity`` (see ``deployments.app``) so that control calls (metrics, health) always get through.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from deployments import request_logging, tracing
from deployments.choices import choice_params, merge_streams
from deployments.config import AppArgs
from deployments.cpu_affinity import replica_engine_cpus, restore_priority
from deployments.engine_request import (
    DEADLINE_EXCEEDED,
    EngineError,
    EngineRequest,
    StreamItem,
    error_item,
)
from deployments.fault_injection import install_stall_hook
from deployments.kv_sharing import DeploymentActor, KVSharing
from deployments.metrics import NAMESPACE_MISMATCH_DOC, AdmittedCounts, ReplicaMetrics
from deployments.replica_report import REGISTRY_ACTOR, ReplicaReporter, detached
from deployments.request_timings import RequestTimings
from deployments.routing_stats import routing_snapshot
from deployments.stats_log import EngineStatsLog
from deployments.stream_items import delta_item, timeout_item
from engine.async_engine import AsyncEngine, EngineDeadError, build_on_own_thread
from engine.block_hash import BlockHash, compute_block_hashes
from engine.gc_heap import freeze_startup_heap
from engine.gil_handoff import shorten_switch_interval
from engine.kernels import native
from engine.llm_engine import LLMEngine
from router.affinity import RecentSessions

logger = logging.getLogger("ray.serve")

KV_DIRECTORY_ACTOR = "kv_directory"
# Coalescing window for a client that waits for the whole answer: every stream item costs CPU in
# both processes, and nobody sees the intermediate ones (the final item is never held back).
NON_STREAMING_COALESCE_S = 1.0
# How long a replica whose engine loop died lingers so that its streams' error items get out
# before it takes itself down (a dead replica answering at once looks idle to the router, which
# would then send it every new request).
ENGINE_DEATH_GRACE_S = 0.5


def _assigned_cpus() -> int | None:
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, round(cpus)) if cpus else None


class EngineReplica:
    """``decode_side``: given to the replicas of the Prefill deployment (prefill/decode
    disaggregation, ``deployments.disaggregation``), the Engine deployment's handle, through
    which they reach its KV directory and replica registry (deployment actors are scoped to
    their deployment, and both sides must share them)."""

    def __init__(self, args: dict[str, Any], decode_side: Any = None) -> None:
        self.args = AppArgs.model_validate(args)
        self.decode_side = decode_side
        if decode_side is not None:
            self.role = "prefill"
        else:
            self.role = "decode" if self.args.disaggregation.enabled else "colocated"
        request_logging.install()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Reported to the routers, which price KV imports by node (router.topology).
        self.node_id: str = ray.get_runtime_context().get_node_id()
        # None: tracing is off (nothing of OpenTelemetry is imported then).
        self.tracer = tracing.setup(self.args.otlp_traces_endpoint)
        self.started_at = time.time()
        config = self.args.engine_config(num_threads=_assigned_cpus())
        self.engine = build_on_own_thread(lambda: LLMEngine(config))
        install_stall_hook(self.engine, self.replica_id)
        self.cpus = (
            replica_engine_cpus(from_top=self.role == "prefill")
            if self.args.pin_engine_cpus
            else None
        )
        restore_priority()
        logger.info(
            "engine replica %s: engine thread on CPUs %s",
            self.replica_id,
            sorted(self.cpus) if self.cpus else "chosen by the kernel",
        )
        self.async_engine = AsyncEngine(
            self.engine,
            items_per_s=self.args.stream_items_per_s,
            cpus=self.cpus,
            stall_timeout_s=self.args.engine_stall_timeout_s,
            batch_wait_s=self.args.batch_wait_ms / 1000.0,
            batch_wait_max_s=self.args.batch_wait_max_ms / 1000.0,
        )
        self.async_engine.on_death = self._on_engine_death
        self.metrics = ReplicaMetrics(self.replica_id, self.args.model_name, ray_export=True)
        # Loaded (or found unavailable, with a WARNING) while the engine was built.
        self.metrics.set_native_kernels(native.unavailable_reason())
        # Reported to the routers, so that one that did not route a session's turn learns where
        # it went (sessions a few minutes idle age out of the report).
        self.recent_sessions = RecentSessions(capacity=16384, window_s=300.0)
        self.admitted = AdmittedCounts(self.metrics.registry, self.replica_id, self.role)
        self.coalesce_s = self.args.stream_interval_ms / 1000.0
        self.kv_sharing: KVSharing | None = None
        if self.args.kv_sharing.enabled:
            # Before the engine thread starts: it becomes the engine's KV connector.
            self.kv_sharing = KVSharing(
                self.replica_id,
                self.async_engine,
                self.args.kv_sharing,
                DeploymentActor(
                    KV_DIRECTORY_ACTOR, None if decode_side is None else self._peer_actor
                ),
                self.metrics,
                node_id=self.node_id,
            )
        self._routing_stats: dict[str, Any] = self._routing_snapshot(self.engine)
        # Warmed up on the engine thread before this constructor returns: Serve reports the
        # replica as starting (and /health answers 503) until then, and the first request
        # pays no first-use cost.
        self.async_engine.start(warm_up=True)
        self.async_engine.wait_ready()
        warmup = self.async_engine.warmup_report
        logger.info("engine replica %s: %s", self.replica_id, warmup)
        if warmup is not None:
            self.metrics.warmup_seconds.labels(replica=self.replica_id).set(warmup.seconds)
        sharing = self.kv_sharing
        self.reporter = ReplicaReporter(
            self.replica_id,
            self.started_at,
            self.engine,
            self.async_engine,
            self.metrics,
            heartbeat=None if sharing is None else sharing.heartbeat,
            stats_log=None
            if self.args.log_stats_interval_s is None
            else EngineStatsLog(self.args.log_stats_interval_s, logger),
            registry=None if decode_side is None else lambda: self._peer_actor(REGISTRY_ACTOR),
        )
        # What exists now lives as long as the replica: later full collections skip it.
        freeze_startup_heap()
        # The event loop and worker threads must not keep the engine thread waiting for the GIL.
        shorten_switch_interval()

    # -- serving ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """Most requests this replica holds at once: the running batch plus the waiting bound
        (None: unbounded). Requests in transit to the engine thread count against it."""
        waiting = self.args.limits.max_waiting_per_replica
        return None if waiting is None else self.args.engine.max_num_seqs + waiting

    async def generate(self, req: EngineRequest) -> AsyncIterator[StreamItem | EngineError]:
        """Stream items for one request; an error is a final ``EngineError`` item, never an
        exception, so the HTTP side can map it to an HTTP status."""
        # This request's task (a context of its own): the ids stay bound, never reset.
        ids = request_logging.RequestIds(req.request_id, req.x_request_id)
        if request_logging.current() != ids:
            request_logging.bind(ids.response_id, ids.x_request_id)
        self._ensure_reporter()
        if req.session_id:
            blocks = len(req.prompt_token_ids) // self.engine.block_size
            self.recent_sessions.touch(req.session_id, blocks, time.time())
        trace = (
            None if self.tracer is None else tracing.ReplicaTrace(self.tracer, req, self.replica_id)
        )
        capacity = self.capacity
        # Checked and counted with no await in between: admission is atomic on the event loop.
        if capacity is not None and self.admitted.count + req.n > capacity:
            self.admitted.rejected.inc()
            refusal = error_item(
                429,
                f"engine replica overloaded: {self.admitted.count} requests admitted "
                f"(limit {capacity})",
                "overloaded_error",
                "overloaded",
            )
            if trace is not None:
                trace.observe(refusal)
                trace.end()
            yield refusal
            return
        # Each choice is a sequence of its own in the engine.
        self.admitted.set(self.admitted.count + req.n)
        try:
            async for item in self._generate(req, trace):
                if trace is not None:
                    trace.observe(item)
                yield item
        finally:
            self.admitted.set(self.admitted.count - req.n)
            if trace is not None:
                trace.end()

    async def _generate(
        self, req: EngineRequest, trace: tracing.ReplicaTrace | None = None
    ) -> AsyncIterator[StreamItem | EngineError]:
        if self.async_engine.error is not None:
            # This replica is about to exit (see _on_engine_death): the caller then sees it die
            # and retries elsewhere. Answer only if the exit is late.
            await asyncio.sleep(4 * ENGINE_DEATH_GRACE_S)
            yield error_item(
                503, "engine replica is shutting down", "engine_error", "engine_dead", True
            )
            return
        params = req.sampling
        timings = RequestTimings(req, self.metrics, self.args.enable_log_requests)
        timeout_s = req.timeout_s or self.args.limits.request_timeout_s
        fetched = None
        if req.handoff and self.kv_sharing is not None:
            # Its blocks are published as its prefill chunks compute them.
            self.kv_sharing.publisher.expect_handoff(req.request_id)
        # Imported KV, like cached KV, has no logits: prompt logprobs compute the whole prompt.
        if self.kv_sharing is not None and params.prompt_logprobs is None:
            fetched = await self.kv_sharing.prefetch(
                len(req.prompt_token_ids), self._block_hashes(req)
            )

        streams = [
            self.async_engine.generate(
                req.request_id if req.n == 1 else f"{req.request_id}-{k}",
                req.prompt_token_ids,
                choice_params(params, k),
                priority=req.priority,
                deadline_ms=req.deadline_ms,
                coalesce_s=self.coalesce_s if req.stream else NON_STREAMING_COALESCE_S,
                cache_salt=req.cache_salt,
                # The other choices find the imported blocks in the prefix cache.
                kv_transfer=fetched if k == 0 else None,
                # Without one from the HTTP side, the choices of this request form the group.
                group_id=req.group_id or req.request_id,
            )
            for k in range(req.n)
        ]
        merged = merge_streams(streams)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:
            while True:
                # The deadline covers the waits for the engine, never the yield: a timeout that
                # fired while this generator is suspended at a yield would cancel its consumer
                # wherever that is awaiting, outside this scope, and no TimeoutError would come.
                # Checked by hand too: with items already queued the wait never suspends, and a
                # scope entered past its deadline would then end before its cancellation lands.
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError
                async with asyncio.timeout_at(deadline):
                    try:
                        index, batch = await anext(merged)
                    except StopAsyncIteration:
                        break
                if batch[-1].finish_reason == "rejected":
                    # Every choice shares the deadline: one rejection answers the request.
                    yield error_item(
                        429,
                        f"deadline_ms: the first token could no longer be served within "
                        f"{req.deadline_ms:g} ms; retry later",
                        "overloaded_error",
                        DEADLINE_EXCEEDED,
                    )
                    return
                done = timings.on_batch(index, batch)
                item = delta_item(self.replica_id, batch, index, done)
                if done and req.handoff and self.kv_sharing is not None:
                    full = len(req.prompt_token_ids) // self.engine.block_size
                    hashes = self._block_hashes(req)[:full]
                    started = time.perf_counter()
                    (
                        item.handoff_blocks,
                        item.handoff_bytes,
                    ) = await self.kv_sharing.publisher.hand_off(hashes, req.request_id)
                    item.handoff_s = time.perf_counter() - started
                yield item
        except TimeoutError:
            unfinished = timings.unfinished()
            for k in unfinished:
                last = timings.last[k]
                yield timeout_item(self.replica_id, req, last, k, done=k == unfinished[-1])
        except ValueError as e:
            yield error_item(400, str(e), "invalid_request_error")
        except EngineDeadError as e:
            # Not retried elsewhere: this request may be what broke the engine.
            yield error_item(503, str(e), "engine_error", "engine_failed")
        except Exception as e:  # noqa: BLE001 - one request's failure must not look like a crash
            logger.exception("request %s failed", req.request_id)
            yield error_item(500, f"internal error: {type(e).__name__}", "internal_error")
        finally:
            await merged.aclose()
            timings.record(trace)
            if req.handoff and self.kv_sharing is not None:
                self.kv_sharing.publisher.forget_handoff(req.request_id)

    def _block_hashes(self, req: EngineRequest) -> list[BlockHash]:
        """The prompt's block hashes under this engine's namespace: the HTTP side's when it
        hashed under the same one (the normal case), else computed here."""
        if req.kv_namespace == self.engine.kv_namespace:
            return req.block_hashes
        if req.kv_namespace is not None:  # a sender that has not yet seen a redeploy
            self.metrics.counter(
                "prefixserve_kv_namespace_mismatch", NAMESPACE_MISMATCH_DOC
            ).labels(replica=self.replica_id).inc()
        root = self.engine.hash_root(req.cache_salt)
        return compute_block_hashes(req.prompt_token_ids, self.engine.block_size, root)

    def deployment_actor(self, name: str) -> Any:
        """This deployment's actor ``name`` (for the Prefill deployment's replicas)."""
        return serve.get_deployment_actor(name)

    async def _peer_actor(self, name: str) -> Any:
        """The Engine deployment's actor ``name``, asked of one of its replicas."""
        return await self.decode_side.deployment_actor.remote(name)

    def kv_namespace(self) -> str:
        """The namespace of this engine's block hashes (``engine.kv_fingerprint``)."""
        return self.engine.kv_namespace

    # -- reporting -------------------------------------------------------------------------------
    def _routing_snapshot(self, engine: LLMEngine) -> dict[str, Any]:
        """Runs on the engine thread (``deployments.routing_stats``)."""
        return routing_snapshot(
            engine, self.replica_id, self.started_at, self.node_id, self.kv_sharing
        )

    async def record_routing_stats(self) -> dict[str, Any]:
        self._ensure_reporter()
        with contextlib.suppress(Exception):
            self._routing_stats = await asyncio.wait_for(
                self.async_engine.call(self._routing_snapshot), timeout=2.0
            )
        # Read here, on the event loop that updates it, not on the engine thread.
        sessions = self.recent_sessions.snapshot(time.time())
        return {**self._routing_stats, "recent_sessions": sessions}

    def check_health(self) -> None:
        self.async_engine.check_health()

    def _on_engine_death(self, error: BaseException) -> None:
        """Engine thread (or its watchdog's, for a stall), after every stream got its error:
        take this replica down, so that callers fail over at once and Serve starts a
        replacement. ``check_health`` fails in the meantime, which Serve acts on too (more
        slowly)."""
        logger.error("engine loop died (%r); replica %s exits", error, self.replica_id)
        time.sleep(ENGINE_DEATH_GRACE_S)
        try:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        finally:
            time.sleep(5.0)
            os._exit(1)

    def _ensure_reporter(self) -> None:
        self.reporter.ensure_started()
        if self.kv_sharing is not None:
            # Its publishing loop is created here: not inside this request's context.
            contextvars.Context().run(self.kv_sharing.start)

    async def cluster_report(self) -> dict[str, dict[str, Any]]:
        """Every live replica's latest report (read from the registry)."""
        self._ensure_reporter()
        return await self.reporter.cluster_report()

    async def kv_directory_stats(self) -> dict[str, Any]:
        if self.kv_sharing is None:
            return {}
        sharing = self.kv_sharing
        return await detached(sharing.call_directory(lambda d: d.stats.remote()))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.async_engine.shutdown(timeout=1.0)
