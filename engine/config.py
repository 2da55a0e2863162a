"""Engine configuration: one frozen dataclass, validated once, passed whole.

It is the one declaration of the engine's options: each field's type, default and bounds (as
``annotated_types`` markers in its annotation) are what :meth:`EngineConfig.validate` checks and
what the serving side's ``args.engine`` model (``deployments.config.EngineArgs``) is built from.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Lt

DType = Literal["auto", "float32", "bfloat16", "float16"]
# How the waiting queue is ordered (engine.scheduling_policy: each is a tuple of scorers).
SchedulingPolicy = Literal["fcfs", "priority", "deadline", "shortest_prompt"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
AttentionBackendName = Literal["auto", "torch", "cpu", "flash"]
Device = Literal["auto", "cpu", "cuda"]
PositiveInt = Annotated[int, Gt(0)]


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
    block_size: PositiveInt = 16
    num_kv_blocks: PositiveInt | None = None
    kv_cache_memory_gb: Annotated[float, Gt(0)] = 1.0
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 2048
    max_model_len: PositiveInt | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    # A request still waiting for its first token when its deadline_ms has passed ends with
    # finish_reason "rejected" (HTTP 429) instead of being served late.
    reject_late_requests: bool = False
    # Fair share (engine.fair_share): while sequences of more than one client request are in the
    # scheduler, one step schedules at most this many of one request's sequences (prompts x n),
    # rotating which; a request alone is never capped. None: off.
    max_seqs_per_group: PositiveInt | None = None
    # Fraction of KV blocks that admission of a new request leaves free, so that running requests
    # can keep decoding without immediate preemption.
    watermark: Annotated[float, Ge(0), Lt(1)] = 0.01
    # Lower the admission watermark after preemptions and let it recover as requests finish
    # (engine.admission_watermark).
    adaptive_watermark: bool = True
    attention_backend: AttentionBackendName = "auto"
    num_threads: PositiveInt | None = None
    # Pack linear weights once for oneDNN on CPU (bf16 always; fp32 for decode-sized batches,
    # at the cost of a second copy of the weights); falls back to F.linear.
    prepack_weights: bool = True
    # Plan step N+1 (schedule, build its inputs) on a second thread while step N's forward runs
    # (engine.step_pipeline); outputs are the same as without it. Off: on a 2-core CPU, whose
    # forward already keeps both cores busy, it measured no faster (docs/performance.md).
    async_scheduling: bool = False
    # vLLM's name: True runs every step eagerly. False (default): on CUDA, with an attention
    # backend that supports CUDA graphs, pure-decode steps replay graphs captured at start-up
    # (engine.cuda_graph). No effect on CPU.
    enforce_eager: bool = False
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
        """Raise ValueError, naming the field, unless every field holds a value of its declared
        type within its declared bounds."""
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model: a model name, directory or .gguf path is required")
        for name, hint in field_types().items():
            _check(name, hint, getattr(self, name))

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


@functools.cache
def field_types() -> dict[str, Any]:
    """Each field's resolved annotation, bounds (``Annotated`` metadata) included, in declaration
    order. Cached: callers must not change it."""
    hints = typing.get_type_hints(EngineConfig, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _check(name: str, hint: Any, value: object) -> None:
    """``value`` against ``hint``: ``T``, ``T | None``, ``Annotated[T, *bounds]`` of a scalar
    ``T`` in ``_KINDS``, or a ``Literal``."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    bounds: tuple[Any, ...] = ()
    if get_origin(hint) is Annotated:
        hint, *rest = get_args(hint)
        bounds = tuple(rest)
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ValueError(f"{name}: must be one of {', '.join(choices)}, got {value!r}")
        return
    if hint not in _KINDS:
        raise TypeError(f"{name}: no check for a field of type {hint!r}")
    ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
    if hint is float:
        ok = _is_number(value)
    ok = ok and all(_within(bound, value) for bound in bounds)
    if not ok:
        limits = " and ".join(_describe(bound) for bound in bounds)
        wanted = f"{_KINDS[hint]} {limits}" if limits else _KINDS[hint]
        raise ValueError(f"{name}: must be {wanted}, got {value!r}")


def _within(bound: Any, value: Any) -> bool:
    if isinstance(bound, Gt):
        return value > bound.gt
    if isinstance(bound, Ge):
        return value >= bound.ge
    if isinstance(bound, Lt):
        return value < bound.lt
    raise TypeError(f"unsupported bound {bound!r}")


def _describe(bound: Any) -> str:
    if isinstance(bound, Gt):
        return f"> {bound.gt}"
    if isinstance(bound, Ge):
        return f">= {bound.ge}"
    return f"< {bound.lt}"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
