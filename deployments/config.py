"""Typed, validated application arguments: the ``args`` of ``serve_config.yaml``.

Ray Serve silently ignores keys it does not know, so every model here forbids extra keys: a typo
in ``args`` stops the application at start-up with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from engine.config import EngineConfig, field_types


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# EngineConfig fields that are not ``args.engine`` options: the model, its tokenizer and the
# hash key are top-level args (the ingress needs them too); the hash salt follows the model,
# so that routers and replicas hash alike; replicas always prepack their weights (the switch
# is for measuring the unpacked path offline).
NOT_ENGINE_ARGS = frozenset({"model", "tokenizer", "kv_hash_key", "hash_salt", "prepack_weights"})


def _engine_arg_fields() -> dict[str, Any]:
    """``(annotation, default)`` of each engine option, from EngineConfig's own declaration:
    the annotations carry the bounds, so pydantic enforces what ``EngineConfig.validate`` does
    and names the field under ``engine``. ``num_threads`` None: the replica's num_cpus."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in NOT_ENGINE_ARGS:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"EngineConfig.{f.name} needs a default to be an engine arg")
        fields[f.name] = (field_types()[f.name], f.default)
    return fields


EngineArgs = create_model(
    "EngineArgs",
    __base__=_Strict,
    __doc__="Every engine option (``engine.config.EngineConfig``) but ``NOT_ENGINE_ARGS``.",
    __module__=__name__,
    **_engine_arg_fields(),
)


class RouterArgs(_Strict):
    """Weights and thresholds of the prefix-aware routing cost (see ``router/``)."""

    prefill_cost_per_block: float = Field(1.0, ge=0)
    load_cost_per_request: float = Field(0.25, ge=0)
    transfer_cost_per_block: float = Field(0.25, ge=0)
    queued_prefill_cost_per_block: float = Field(0.25, ge=0)
    min_match_blocks: int = Field(1, ge=0)
    prefix_home: bool = True
    evict_oldest: bool = True
    holder_margin_per_block: float = Field(1.0, ge=0)
    imbalance_abs: int = Field(8, ge=0)
    imbalance_rel: float = Field(2.0, ge=1)
    # Seconds a routing decision counts as cached on its replica after the request completes,
    # unless a newer routing-stats report says otherwise.
    decision_ttl_s: float = Field(30.0, gt=0)
    # Session affinity and hot-prefix replication (router.RouterConfig says what each means).
    session_capacity: int = Field(65536, ge=0)
    hot_prefix_rate: float = Field(1.0, ge=0)
    hot_prefix_window_s: float = Field(10.0, gt=0)
    hot_prefix_cost_per_block: float = Field(0.25, ge=0)
    hot_prefix_max_replicas: int = Field(2, ge=0)
    hot_prefix_capacity: int = Field(16384, ge=0)
    # How often Serve polls each engine replica's record_routing_stats().
    stats_period_s: float = Field(1.0, gt=0)


class RayPrefixAffinityArgs(_Strict):
    """Init kwargs of Ray Serve's own ``PrefixCacheAffinityRouter`` (``routing_policy:
    ray_prefix_affinity``); the defaults are Ray's."""

    # Queue-length spread between replicas beyond which Ray's router ignores prefixes and picks
    # by power of two choices. None: Ray's default, infinite (load never overrides a match).
    imbalanced_threshold: float | None = Field(None, ge=0)
    # Least fraction of the prompt's characters a replica must hold to be preferred for them.
    match_rate_threshold: float = Field(0.1, ge=0, le=1)


class KVSharingArgs(_Strict):
    """Prefix KV blocks published to Ray's object store and imported by other replicas."""

    enabled: bool = True
    capacity_bytes: int = Field(2 << 30, gt=0)
    eviction: Literal["lru", "fifo"] = "lru"
    min_blocks: int = Field(4, ge=1)
    fetch_timeout_s: float = Field(5.0, gt=0)
    # Blocks per published object: eviction from the directory (and so from the object store)
    # frees whole objects, so smaller objects track the byte budget more finely.
    max_blocks_per_object: int = Field(32, ge=1)
    # Bytes one replica fetches from the object store at once; past it, prompts recompute.
    max_import_bytes: int = Field(512 << 20, gt=0)


class DisaggregationArgs(_Strict):
    """Prefill/decode disaggregation (docs/disaggregation.md): eligible prompts are computed on a
    Prefill deployment of the same engine, which hands their KV to the Engine deployment (the
    decode side) through the KV directory. Routed layout with KV sharing only."""

    enabled: bool = False
    # Replicas of the Prefill deployment (a ``Prefill`` entry under ``deployments`` in
    # serve_config.yaml overrides it, as it may any Serve option).
    prefill_replicas: int = Field(1, ge=1)
    # Inter-token SLO (milliseconds per output token) for choosing a handed-off prompt's decode
    # replica: replicas predicted to keep it with one more stream are preferred, among those
    # the router ranks by where the KV is and load; when none keeps it the best one still
    # decodes it (counted in prefixserve_tbt_slo_misses_total). None: ranked as any request.
    tbt_slo_ms: float | None = Field(None, gt=0, allow_inf_nan=False)


class LimitsArgs(_Strict):
    """Admission limits; beyond them requests get a 4xx instead of unbounded memory.

    Every queue on a request's path is bounded, and overflowing any of them answers 429 with a
    ``Retry-After`` header (OpenAI clients retry on it):

    * Serve's HTTP proxy waiting for an ingress replica: ``max_queued_at_proxy``;
    * an ingress replica: ``max_ongoing_per_ingress`` sequences in flight, streams included;
    * an ingress replica waiting for a free engine replica: ``max_queued_for_engine``;
    * an engine replica: ``engine.max_num_seqs`` running plus ``max_waiting_per_replica``.
    """

    max_body_bytes: int = Field(4 << 20, gt=0)
    max_prompt_tokens: int | None = Field(None, gt=0)
    max_tokens: int = Field(4096, gt=0)
    # Requests an engine replica holds beyond its running batch (waiting in its scheduler or in
    # transit to its engine thread) before it answers 429; 0: none beyond the batch; None: no
    # bound.
    max_waiting_per_replica: int | None = Field(256, ge=0)
    # Sequences in flight through one ingress replica before it answers 429: a request counts
    # prompts x n (each a row of an engine's batch), so one wide request weighs what it costs. A
    # request wider than this alone gets a 400 naming n (or prompt), never a 429 forever.
    max_ongoing_per_ingress: int = Field(1024, gt=0)
    # Requests one ingress replica queues while every engine replica is at Serve's
    # max_ongoing_requests (the Engine deployment's max_queued_requests): only while replicas
    # start or stop, since replicas refuse past their own limit first. None: as many as the
    # ingress admits (Serve counts calls still being routed as queued, so a smaller queue can
    # refuse a burst that the replicas have room for).
    max_queued_for_engine: int | None = Field(None, gt=0)
    # Requests Serve's HTTP proxy queues while every ingress replica is at its
    # max_ongoing_requests (the Ingress deployment's max_queued_requests). Past it the proxy
    # answers 429 itself (a plain-text body), the cheapest refusal there is.
    max_queued_at_proxy: int = Field(64, gt=0)
    # Seconds sent in Retry-After with every 429 and 503.
    retry_after_s: int = Field(1, ge=0)
    # Wall-clock limit per request at the engine replica; an expired request ends with
    # finish_reason "timeout". The default is far above what a request of max_tokens takes on a
    # busy CPU, and still ends one that nobody reads (a stalled client keeps its sequence in the
    # batch otherwise). None: no limit.
    request_timeout_s: float | None = Field(900.0, gt=0)
    # Seconds the whole request body may take to arrive; a client that sends it slower (or never
    # finishes it) gets a 408 and frees its slot.
    body_read_timeout_s: float = Field(30.0, gt=0)


class AppArgs(_Strict):
    model: str = "smollm2-135m-instruct"
    # "direct": each engine replica serves the HTTP routes itself (no process hop per token;
    # one machine, docs/benchmarks.md). "routed": an Ingress deployment validates requests and
    # routes each prompt by its prefix to engine replicas through a handle (many replicas and
    # nodes, KubeRay).
    layout: Literal["direct", "routed"] = "routed"
    served_model_name: str | None = None
    tokenizer: str | None = None
    engine: EngineArgs = EngineArgs()
    # least_connections: no request router of ours (direct layout: HAProxy balances alone; a
    # single replica needs nothing more). ray_prefix_affinity: Ray Serve's own
    # PrefixCacheAffinityRouter, for comparison (routed layout only).
    routing_policy: Literal[
        "prefix_aware", "power_of_two", "round_robin", "least_connections", "ray_prefix_affinity"
    ] = "prefix_aware"
    router: RouterArgs = RouterArgs()
    ray_prefix_affinity: RayPrefixAffinityArgs = RayPrefixAffinityArgs()
    kv_sharing: KVSharingArgs = KVSharingArgs()
    disaggregation: DisaggregationArgs = DisaggregationArgs()
    limits: LimitsArgs = LimitsArgs()
    # Bearer token required on every route but /ping (the liveness probe's); also read from
    # PREFIXSERVE_API_KEY.
    api_key: str | None = None
    # Secret that keys the block hashes (engine.block_hash), so that no client can compute one
    # offline and search for a prefix that collides with another tenant's. None: a fresh one is
    # generated each time the application is built (deployments.app.build); set it to keep
    # hashes stable across deploys.
    kv_hash_key: str | None = Field(None, min_length=16)
    # False: responses leave out usage.prompt_tokens_details.cached_tokens and the
    # x-engine-replica header, which tell a client whether another client's prompt is cached
    # (tenants that must not learn that also send distinct cache_salt values).
    report_cache_hits: bool = True
    # Tokens produced within this window after the first are sent as one stream item.
    stream_interval_ms: float = Field(20.0, ge=0)
    # Most stream items per second an engine replica sends, over all its streams together; under
    # load each stream's window widens to (streams / this) seconds. None: no cap. Every item costs
    # ~1-3 ms of CPU across the replica, the ingress and the proxy (docs/benchmarks.md);
    # the KubeRay manifests set 25 (serve_config.yaml's direct layout leaves it unset).
    stream_items_per_s: float | None = Field(None, gt=0)
    # An idle engine replica that receives a request keeps taking the requests that arrive
    # within this many ms of the previous one (for batch_wait_max_ms at most, and only until the
    # waiting prompts fill a step) before it starts computing: a burst of concurrent requests
    # then starts in one step instead of behind its first request's lone step. A request alone
    # waits this long more for its first token. 0: off. Measured: docs/benchmarks.md ("An idle
    # replica gathers a burst").
    batch_wait_ms: float = Field(10.0, ge=0)
    batch_wait_max_ms: float = Field(100.0, gt=0)
    # How the ingress reaches engine replicas: "actor" (Ray actor calls) or "grpc" (Serve's gRPC
    # channel to the replica: about a quarter less ingress CPU per stream item, which matters at
    # a message per token and was lost in the noise at the default item budget).
    handle_transport: Literal["grpc", "actor"] = "actor"
    # Pin each engine replica's compute thread to CPUs of its own, where Ray owns the node's
    # CPUs (see deployments/cpu_affinity.py); off: the kernel places it.
    pin_engine_cpus: bool = True
    # Seconds an engine replica's engine thread may spend on one step (or command) before its
    # watchdog declares it stalled: health checks fail, live streams end with an error event and
    # the replica exits so that Serve replaces it. A stalled step cannot be interrupted, only
    # abandoned. The default leaves room for the longest legitimate step on 2 busy cores (a
    # full max_num_batched_tokens prefill chunk of a larger model takes tens of seconds) plus
    # first-use work in it. None: no watchdog.
    engine_stall_timeout_s: float | None = Field(120.0, gt=0)
    # One INFO line per request at the HTTP side and two at its engine replica (added, finished),
    # each carrying the response id and x-request-id (as vLLM's --enable-log-requests).
    enable_log_requests: bool = False
    # Seconds between an engine replica's stats lines (running, waiting, KV usage, prefix hit
    # ratio, tokens/s); written while the replica is busy and once when it goes idle. None: none.
    log_stats_interval_s: float | None = Field(10.0, gt=0)
    # OTLP endpoint that receives OpenTelemetry traces of requests (as vLLM's
    # --otlp-traces-endpoint; needs the `tracing` extra). None: off, unless the environment sets
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (deployments/tracing.py).
    otlp_traces_endpoint: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> AppArgs:
        self.engine_config()  # raises ValueError naming the field
        if self.routing_policy == "least_connections" and self.layout != "direct":
            raise ValueError(
                "routing_policy: least_connections is HAProxy's balancing, for layout: direct"
            )
        if self.routing_policy == "ray_prefix_affinity" and self.layout != "routed":
            # The direct layout's replica chooser only asks for a replica (HAProxy sends the
            # request): Serve then never tells the router where a request went, and Ray's
            # router learns prefixes only from that report.
            raise ValueError(
                "routing_policy: ray_prefix_affinity needs layout: routed (Ray's router learns "
                "where prefixes went only from requests sent through the Engine handle)"
            )
        if self.disaggregation.enabled and self.layout != "routed":
            raise ValueError(
                "disaggregation.enabled needs layout: routed (the ingress hands each prompt "
                "from a prefill replica to a decode replica)"
            )
        if self.disaggregation.enabled and not self.kv_sharing.enabled:
            raise ValueError(
                "disaggregation.enabled needs kv_sharing.enabled (the prompt's KV goes from "
                "the prefill replica to the decode replica through the KV directory)"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("PREFIXSERVE_API_KEY") or None

    def engine_config(self, num_threads: int | None = None) -> EngineConfig:
        options = self.engine.model_dump()
        if options["num_threads"] is None:
            options["num_threads"] = num_threads
        return EngineConfig(
            model=self.model, tokenizer=self.tokenizer, kv_hash_key=self.kv_hash_key, **options
        )
