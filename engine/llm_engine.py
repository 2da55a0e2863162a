"""The step-level engine: add requests, step, abort. Single-threaded by contract; the serving
layer drives it from one background thread (see ``engine.async_engine``)."""

from __future__ import annotations

import logging
import operator
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.allocator import keep_freed_memory
from engine.attention import backend_for_model, select_backend
from engine.bad_words import word_token_ids
from engine.block_hash import BlockHash, hash_key, hash_root
from engine.config import EngineConfig
from engine.cpuinfo import cpu_has_bf16
from engine.cuda_graph import CudaGraphCapture, use_cuda_graphs
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.kv_connector import KVConnector
from engine.kv_fingerprint import kv_fingerprint, model_digest
from engine.kv_transfer import KVLayoutError, block_shape, export_blocks, import_blocks
from engine.model.config import model_config_from_hf, rope_tables
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    load_hf_config,
    load_safetensors,
    resolve_model,
    resolve_tokenizer,
)
from engine.model_runner import ModelRunner, ScheduledSeq, StepOutput
from engine.outputs import RequestDelta
from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_pipeline import StepPipeline
from engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


# Steps with at least this many prompt tokens time the prefill speed (KV sharing's cost model).
PREFILL_SAMPLE_MIN_TOKENS = 64
EWMA_WEIGHT = 0.2


@dataclass
class EngineStats:
    """Cumulative counters and current gauges, read by the metrics exporter."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cache_hit_tokens_local: int = 0
    cache_hit_tokens_remote: int = 0
    finished: Counter = field(default_factory=Counter)
    num_preemptions: int = 0
    # Requests that missed their deadline (first token), by what became of them: "rejected"
    # (with reject_late_requests) or "late" (served after it).
    deadline_missed: Counter = field(default_factory=Counter)
    # Blocks in use up to which admission admits new requests (engine.admission_watermark).
    admission_watermark_blocks: int = 0
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    # Seconds per prompt token of recent prefill-heavy steps (a moving average; None: none yet).
    prefill_s_per_token: float | None = None
    # Seconds between the starts of consecutive steps that both carry decode rows: the time per
    # output token a running stream gets now (a moving average; None: none yet).
    decode_step_s: float | None = None

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / tokens)

    def observe_decode_step(self, seconds: float) -> None:
        self.decode_step_s = _ewma(self.decode_step_s, seconds)


def _ewma(prev: float | None, sample: float) -> float:
    return sample if prev is None else prev + EWMA_WEIGHT * (sample - prev)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or
    AMX), float32 elsewhere. Without native bf16, an explicit bfloat16 keeps bf16 weights and KV
    cache but multiplies batches of more than a few rows in float32 (``linear.upcast_linear``):
    on an AVX2-only CPU W1 then ran a little slower than float32 and batch-1 decode faster,
    since a lone sequence is bound by reading the weights (docs/performance.md)."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    if device.type == "cpu" and name == "bfloat16" and not cpu_has_bf16():
        logger.info(
            "dtype bfloat16 on a CPU without native bf16 arithmetic (no avx512_bf16 or "
            "amx_bf16): weights and KV cache are bf16, matmuls of more than a few rows run in "
            "float32; dtype 'auto' picks float32 here"
        )
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def as_token_ids(prompt: object) -> list[int]:
    """A token-id prompt as a list of Python ints. Any integer type passes (numpy, torch
    scalars, arrays); bools and floats do not, since ``int()`` would silently truncate them."""
    if not isinstance(prompt, Iterable) or isinstance(prompt, bytes | Mapping):
        raise ValueError("prompt: must be a string or a list of token ids")
    try:
        ids = list(prompt)
        if any(isinstance(t, bool) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt: token ids must be integers") from None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model)
        hf_config, generation_config = load_hf_config(self.model_dir)
        self.model_cfg = model_config_from_hf(hf_config, generation_config)
        self.tokenizer = resolve_tokenizer(config.tokenizer, self.model_dir)
        eos = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(
            self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids
        )

        self.max_model_len = config.max_model_len or self.model_cfg.max_position_embeddings
        if self.max_model_len > self.model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"{self.model_cfg.max_position_embeddings} positions"
            )
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.hash_salt = config.hash_salt if config.hash_salt is not None else config.model
        cfg = self.model_cfg
        self.kv_fingerprint = kv_fingerprint(
            model_digest(self.model_dir),
            self.dtype,
            config.block_size,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        # The namespace of every block hash this engine makes (engine.block_hash).
        self.kv_namespace = f"{self.hash_salt}|{self.kv_fingerprint}"
        self.hash_key = hash_key(config.kv_hash_key)

        chosen = select_backend(config.attention_backend, self.device, self.dtype)
        needs_window = any(cfg.layer_window(i) for i in range(cfg.num_layers))
        backend = backend_for_model(chosen, needs_window, cfg.attn_softcap is not None)
        if backend is not chosen:
            logger.info(
                "attention: %s takes the torch backend (%s has no sliding window or soft-capping)",
                cfg.model_type,
                chosen.name,
            )
        model = LlamaForCausalLM(self.model_cfg, backend, self.dtype)
        model.load_hf_weights(load_safetensors(self.model_dir))
        model.set_rope_tables(*rope_tables(hf_config, self.model_cfg, self.max_model_len))
        model.to(self.device)
        if config.prepack_weights:
            model.prepack_linear_weights()
        self.model = model.eval()

        num_blocks = config.num_kv_blocks or self._blocks_for_memory()
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, config.watermark
        )
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.sampler = Sampler(config.seed)
        graphs = None
        if use_cuda_graphs(self.device, backend, config.enforce_eager):
            graphs = CudaGraphCapture(self.device)
        self.runner = ModelRunner(
            self.model,
            self.model_cfg,
            backend,
            num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            self.sampler,
            capture=graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.stats = EngineStats(num_blocks=num_blocks)
        # An external KV store (engine.kv_connector); set before the engine thread starts.
        self.kv_connector: KVConnector | None = None
        # The latest step's decoding sequences and when its forward began (observe_prefill).
        self._decoding: set[str] = set()
        self._decoding_at = 0.0
        self._pipeline = StepPipeline(self) if config.async_scheduling else None
        self._update_gauges()
        logger.info(
            "engine ready: %s (%s %s, %s, forward=%s, attention=%s, decode graphs=%s), "
            "%d KV blocks of %d tokens",
            self.model_dir,
            self.model_cfg.model_type,
            self.device,
            self.dtype,
            self.model.forward_path(),
            backend.name,
            self.runner.graphs.sizes if self.runner.graphs is not None else "off",
            num_blocks,
            config.block_size,
        )

    def _blocks_for_memory(self) -> int:
        per_block = self.model_cfg.kv_bytes_per_block(self.config.block_size, self.dtype)
        return max(1, int(self.config.kv_cache_memory_gb * (1 << 30)) // per_block)

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_cfg.vocab_size
        if any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids
        ):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids: token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        needed = cdiv(
            min(len(token_ids) + params.max_tokens, self.max_model_len), self.config.block_size
        )
        if needed > self.num_blocks:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens plus max_tokens={params.max_tokens} need "
                f"{needed} KV blocks, more than the {self.num_blocks} this engine has"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline_ms: float | None = None,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> Request:
        """Queue a request; no model work happens here."""
        request = self.make_request(
            request_id,
            prompt,
            params,
            priority=priority,
            arrival_time=arrival_time,
            deadline_ms=deadline_ms,
            cache_salt=cache_salt,
            group_id=group_id,
        )
        self.add_prepared_request(request)
        return request

    def add_prepared_request(self, request: Request) -> None:
        """Queue a request built by ``make_request`` (possibly on another thread)."""
        if (
            self.kv_connector is not None
            and self.kv.enable_caching
            and not request.skips_prefix_cache
        ):
            self._load_external(request, self.kv_connector)
        self.scheduler.add_request(request)
        self._update_gauges()

    def _load_external(self, request: Request, connector: KVConnector) -> None:
        """Install what the connector has for the request's uncached prompt blocks."""
        usable = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        try:
            blocks = connector.load(request, self.num_cached_prefix_blocks(usable))
        except Exception:  # noqa: BLE001 - a store's failure costs a recompute, nothing more
            logger.warning("KV connector failed for %s", request.request_id, exc_info=True)
            return
        if blocks is None:
            return
        try:
            _, installed = import_blocks(self.kv, self.runner, blocks.hashes, blocks.chunks)
        except KVLayoutError as e:
            logger.warning("refused imported KV for %s: %s", request.request_id, e)
            connector.loaded(request, 0, str(e))
            return
        request.num_remote_cached_tokens = installed * self.block_size
        connector.loaded(request, installed, None)

    def num_cached_prefix_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading ``hashes`` are cached here. Safe from any thread as a hint (each
        lookup is atomic; the answer may be stale by the time it is used)."""
        n = 0
        for h in hashes:
            if self.kv.pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def export_prefix(self, hashes: list[BlockHash]) -> tuple[list[BlockHash], torch.Tensor]:
        """Engine thread: the KV of the longest leading run of ``hashes`` cached here, a CPU copy
        laid out as ``engine.kv_transfer`` describes."""
        return export_blocks(self.kv, self.runner, hashes)

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One exported block's shape (``engine.kv_transfer.block_shape``)."""
        return block_shape(self.runner)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline_ms: float | None = None,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> Request:
        """Validate and build a request without touching engine state (thread-safe). Requests
        with different ``cache_salt`` share no cached block (``engine.block_hash``).
        ``deadline_ms``: when its first token is due, counted from ``arrival_time``.
        ``group_id``: the client request it belongs to (``engine.fair_share``; None: its own)."""
        params = params or SamplingParams()
        if deadline_ms is not None and not (
            isinstance(deadline_ms, int | float)
            and not isinstance(deadline_ms, bool)
            and 0 < deadline_ms < float("inf")
        ):
            raise ValueError(f"deadline_ms: must be a positive number, got {deadline_ms!r}")
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else as_token_ids(prompt)
        self.validate_prompt(token_ids, params)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                params.skip_special_tokens,
                params.stop_strings,
                params.include_stop_str_in_output,
                prompt_token_ids=token_ids,
            )
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            arrival_time=arrival_time,
            deadline_ms=deadline_ms,
            detokenizer=detok,
            block_size=self.config.block_size,
            hash_root=self.hash_root(cache_salt),
            group_id=group_id,
        )
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this model has no tokenizer")
            request.bad_word_tokens = word_token_ids(self.tokenizer, params.bad_words)
        if params.seed is not None:
            request.generator = torch.Generator().manual_seed(params.seed)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        self.stats.finished["abort"] += 1
        self._update_gauges()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule, run and process one step; returns its deltas. With
        ``async_scheduling`` the next step is planned while this one's forward runs
        (``engine.step_pipeline``)."""
        if self._pipeline is not None:
            return self._pipeline.step()
        out = self.scheduler.schedule()
        rejected = self.begin_step(out)
        if out.is_empty:
            return rejected
        started = time.perf_counter()
        step = self.runner.execute(self.scheduled_seqs(out))
        self.observe_prefill(out, started)
        self.scheduler.update_from_output(out)
        self.report_prefill_chunks(out)
        return rejected + self.finish_step(step)

    def scheduled_seqs(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        return [ScheduledSeq(r, n, self.kv.block_ids(r.request_id)) for r, n in out.scheduled]

    def begin_step(self, out: SchedulerOutput) -> list[RequestDelta]:
        """Account for a step about to run (``engine.step_pipeline`` calls this and the other
        phases too); returns the deltas of the requests it rejected."""
        self.stats.num_preemptions = self.scheduler.num_preemptions_total
        rejected = [self._rejected_delta(r) for r in out.rejected]
        scheduled_at = time.monotonic()
        for request in out.first_scheduled:
            request.scheduled_time = scheduled_at
            self.stats.prompt_tokens += request.num_prompt_tokens
            remote = min(request.num_remote_cached_tokens, request.num_cached_tokens)
            self.stats.cache_hit_tokens_local += request.num_cached_tokens - remote
            self.stats.cache_hit_tokens_remote += remote
        if out.is_empty:
            self._update_gauges()  # finish_step will not
        return rejected

    def observe_prefill(self, out: SchedulerOutput, started: float) -> None:
        """Time the step whose forward began at ``started``: the prefill speed, and the
        interval since the previous step's start when a sequence decodes in both (one token
        of its stream: an idle engine between them is never counted)."""
        prefill_tokens = sum(n for _, n in out.scheduled if n > 1)
        if prefill_tokens >= PREFILL_SAMPLE_MIN_TOKENS:
            # Decodes sharing the step are few rows next to a chunk of this size.
            self.stats.observe_prefill(time.perf_counter() - started, prefill_tokens)
        decoding = {r.request_id for r, n in out.scheduled if n == 1}
        if not decoding.isdisjoint(self._decoding):
            self.stats.observe_decode_step(started - self._decoding_at)
        self._decoding, self._decoding_at = decoding, started

    def report_prefill_chunks(self, out: SchedulerOutput) -> None:
        """Once the step ran and its progress is counted: tell the KV connector about each
        prompt the step computed a chunk of without finishing it (``finish_step`` reports the
        finished ones, at their first token)."""
        if self.kv_connector is None:
            return
        for request, _ in out.scheduled:
            if request.num_computed_tokens < request.num_tokens:
                self.kv_connector.on_prefill_chunk(request)

    def finish_step(self, step: StepOutput) -> list[RequestDelta]:
        """Append the step's sampled tokens, stop what must stop, and build its deltas (the
        scheduler has already counted the step's progress)."""
        sampled, result = step.sampled, step.sampler
        for request, entries in step.prompt_logprobs:
            request.prompt_logprobs.extend(entries)
        self.stats.num_steps += 1

        now = time.monotonic()
        deltas = []
        for request, token, logprobs in zip(
            sampled, result.token_ids, result.logprobs, strict=True
        ):
            request.append_output_token(token)
            first = request.first_token_time is None
            if first:
                request.first_token_time = now
                if request.deadline is not None and now > request.deadline:
                    request.missed_deadline = True
                    self.stats.deadline_missed["late"] += 1
                if self.kv_connector is not None:
                    self.kv_connector.on_prompt_computed(request)
            status = self._check_stop(request, token)
            if status is not None:
                self.scheduler.finish_request(request, status)
                self.stats.finished[status.finish_reason] += 1
            if logprobs is not None:
                request.logprobs.append(logprobs)
            text = (
                request.detokenizer.take_delta(request.is_finished) if request.detokenizer else ""
            )
            deltas.append(
                RequestDelta(
                    request_id=request.request_id,
                    new_token_ids=[token],
                    new_text=text,
                    finished=request.is_finished,
                    finish_reason=request.finish_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_remote_cached_tokens=request.num_remote_cached_tokens,
                    scheduled_time=request.scheduled_time,
                    first_token_time=request.first_token_time,
                    stop_reason=request.stop_reason,
                    logprobs=[logprobs] if logprobs is not None else None,
                    prompt_logprobs=list(request.prompt_logprobs)
                    if first and request.prompt_logprobs
                    else None,
                )
            )
        self.stats.generation_tokens += len(deltas)
        self._update_gauges()
        return deltas

    def _rejected_delta(self, request: Request) -> RequestDelta:
        """The one and final delta of a request the scheduler rejected: no token."""
        self.stats.finished["rejected"] += 1
        self.stats.deadline_missed["rejected"] += 1
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=0,
            num_cached_tokens=0,
            num_remote_cached_tokens=0,
        )

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        reached_min = request.num_output_tokens >= params.min_tokens
        stop_str = request.detokenizer.append(token, reached_min) if request.detokenizer else None
        # The sampler only offers tokens the grammar allows; once it is complete (it then allows
        # only EOS) or, defensively, rejects a token, the output is done.
        grammar = request.grammar
        if grammar is not None and (not grammar.consume_token(token) or grammar.is_stopped()):
            return RequestStatus.FINISHED_STOPPED
        # Before min_tokens, the sampler cannot pick EOS or stop tokens and stop strings wait.
        if reached_min:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if stop_str is not None:
                request.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def reset_counters(self) -> None:
        """Counters and the admission watermark as a fresh engine has them (after a warm-up);
        only while idle."""
        assert not self.has_unfinished_requests()
        self.scheduler.num_preemptions_total = 0
        self.scheduler.watermark.reset()
        # The prefill rate measured meanwhile is this engine's own: kept.
        self.stats = EngineStats(
            num_blocks=self.num_blocks, prefill_s_per_token=self.stats.prefill_s_per_token
        )
        self._update_gauges()

    def _update_gauges(self) -> None:
        s = self.stats
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.kv_usage = self.kv.usage()
        s.num_free_blocks = self.kv.pool.num_free_blocks
        s.admission_watermark_blocks = self.scheduler.watermark.level

    # -- introspection ---------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    def model_info(self) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "model_dir": str(self.model_dir),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "max_model_len": self.max_model_len,
            "block_size": self.config.block_size,
            "num_kv_blocks": self.num_blocks,
            "hash_salt": self.hash_salt,
            "kv_namespace": self.kv_namespace,
        }

    def hash_root(self, cache_salt: str | None = None) -> bytes:
        """The root of this engine's block hash chains for requests with ``cache_salt``."""
        return hash_root(self.kv_namespace, self.hash_key, cache_salt)
