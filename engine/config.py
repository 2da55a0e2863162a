"""Engine configuration: one frozen dataclass, validated once, passed whole."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

DType = Literal["auto", "float32", "bfloat16", "float16"]
# How the waiting queue is ordered (engine.scheduling_policy: each is a tuple of scorers).
SchedulingPolicy = Literal["fcfs", "priority", "deadline", "shortest_prompt"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
AttentionBackendName = Literal["auto", "torch", "cpu", "flash"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start.

    ``num_kv_blocks=None`` sizes the KV cache from ``kv_cache_memory_gb`` (default 1 GiB on CPU);
    ``max_model_len=None`` takes the model's ``max_position_embeddings``.
    """

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: DType = "auto"
    device: Device = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    # A request still waiting for its first token when its deadline_ms has passed ends with
    # finish_reason "rejected" (HTTP 429) instead of being served late.
    reject_late_requests: bool = False
    # Fair share (engine.fair_share): while sequences of more than one client request are in the
    # scheduler, one step schedules at most this many of one request's sequences (prompts x n),
    # rotating which; a request alone is never capped. None: off.
    max_seqs_per_group: int | None = None
    # Fraction of KV blocks that admission of a new request leaves free, so that running requests
    # can keep decoding without immediate preemption.
    watermark: float = 0.01
    # Lower the admission watermark after preemptions and let it recover as requests finish
    # (engine.admission_watermark).
    adaptive_watermark: bool = True
    attention_backend: AttentionBackendName = "auto"
    num_threads: int | None = None
    # Pack linear weights once for oneDNN on CPU (bf16 always; fp32 for decode-sized batches,
    # at the cost of a second copy of the weights); falls back to F.linear.
    prepack_weights: bool = True
    # Plan step N+1 (schedule, build its inputs) on a second thread while step N's forward runs
    # (engine.step_pipeline); outputs are the same as without it. Off: on a 2-core CPU, whose
    # forward already keeps both cores busy, it measured no faster (docs/performance.md).
    async_scheduling: bool = False
    seed: int = 0
    # Salt of the chained block hashes; defaults to the resolved model name, so that two models'
    # hashes never collide in a router or a shared KV directory.
    hash_salt: str | None = None
    # Secret that keys the block hashes (engine.block_hash): without it no one can compute a
    # block's hash offline. Engines that share KV or a router must share it; None: unkeyed.
    kv_hash_key: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model: a model name, directory or .gguf path is required")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "max_seqs_per_group"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not _is_number(self.kv_cache_memory_gb) or self.kv_cache_memory_gb <= 0:
            raise ValueError(
                f"kv_cache_memory_gb: must be positive, got {self.kv_cache_memory_gb!r}"
            )
        if not _is_number(self.watermark) or not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark!r}")
        for name in (
            "enable_prefix_caching",
            "reject_late_requests",
            "adaptive_watermark",
            "async_scheduling",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        for name in ("tokenizer", "hash_salt", "kv_hash_key"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a string, got {getattr(self, name)!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype: must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "flash"):
            raise ValueError(
                "attention_backend: must be auto, torch, cpu or flash, "
                f"got {self.attention_backend!r}"
            )

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
