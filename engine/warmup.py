"""Warm-up: run each batch shape class the step will meet once, before the engine serves.

The first step of each kind pays one-time costs that a request should not: the native kernels
are compiled or loaded on first use, oneDNN creates its primitives per shape class (prefill rows,
decode rows, the fp32 and bf16 packed paths), the attention backend takes different paths for a
long prefill, a short one, a prefill over cached context and a decode, and the engine thread's
OpenMP team starts on its first parallel op. Run on the thread that will serve (the team stays).

Each class is a small request set pushed through ``LLMEngine.step`` to completion:

* ``prefill_long``: one prompt long enough for the multi-row paths (oneDNN, SDPA or the tile
  kernel), then ``decode_1``: its batch-1 decode steps (the native forward where it applies);
* ``prefill_prefix_hit`` and ``decode_batch``: up to ``max_num_seqs`` prompts behind the first
  one's prefix (two compute a chunk over the cached context, the rest one token, which keeps the
  warm-up short), decoding together (the largest decode batch), sampled with seeds;
* ``mixed``: a prefill chunk and decodes in one step.

Afterwards nothing of it remains: every block is free, the prefix cache is cleared, and the
counters are those of a fresh engine (requests ids start with ``warmup-``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SHAPE_CLASSES = (
    "prefill_long",
    "decode_1",
    "prefill_prefix_hit",
    "decode_batch",
    "mixed",
)
# Tokens of the long prompt, and of the cached prefix the batch's prompts share (with prefix
# caching); capped by the engine's limits.
LONG_PROMPT_TOKENS = 256
MAX_STEPS = 10_000


@dataclass
class WarmupReport:
    """What the warm-up ran: the shape classes in order, engine steps and wall time."""

    shape_classes: list[str] = field(default_factory=list)
    steps: int = 0
    requests: int = 0
    seconds: float = 0.0


def _tokens(n: int, start: int, vocab: int) -> list[int]:
    """``n`` ordinary token ids (never the low ids that tokenizers keep for special tokens)."""
    low = min(16, vocab - 1)
    span = vocab - low
    return [low + (start + 7919 * i) % span for i in range(n)]


def warm_up(engine: LLMEngine, on_step: Callable[[], None] | None = None) -> WarmupReport:
    """Run every shape class once on ``engine``, which must be idle; leaves it as it was.
    ``on_step`` is called after each engine step (a watchdog's sign of progress)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm-up needs an idle engine")
    report = WarmupReport()
    started = time.monotonic()
    vocab = engine.model_cfg.vocab_size
    cfg = engine.config
    # Warm-up prompts are neither published to nor looked up in an external KV store.
    connector, engine.kv_connector = engine.kv_connector, None
    # Room to generate within max_model_len and the pool, and one chunk per prefill.
    bs = cfg.block_size
    long_len = max(
        2,
        min(
            LONG_PROMPT_TOKENS,
            cfg.max_num_batched_tokens,
            engine.max_model_len - 8,
            (engine.num_blocks // 2) * bs - 8,
        ),
    )
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    long_prompt = _tokens(long_len, 1, vocab)
    try:
        _run(engine, report, on_step, ["prefill_long", "decode_1"], [long_prompt], greedy)
        # Without prefix caching nothing is shared: every prompt is short.
        prefix_len = (long_len - 1) // bs * bs if cfg.enable_prefix_caching else 0
        prefix = long_prompt[:prefix_len]
        # Each sequence's own blocks (suffix and outputs), within half of the pool.
        own_blocks = -(-(bs + 3) // bs) + 1
        n = max(1, min(cfg.max_num_seqs, (engine.num_blocks // 2) // own_blocks))
        batch = [
            prefix + _tokens(bs if i < 2 or not prefix else 1, 100 + i, vocab) for i in range(n)
        ]
        sampled = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(n)]
        _run(engine, report, on_step, ["prefill_prefix_hit", "decode_batch"], batch, sampled)
        _run_mixed(engine, report, on_step, _tokens(min(8, long_len), 500, vocab), greedy)
    finally:
        engine.kv_connector = connector
    _forget(engine)
    report.seconds = time.monotonic() - started
    logger.info(
        "warm-up: %s in %d steps, %.2f s", ", ".join(report.shape_classes), report.steps,
        report.seconds,
    )  # fmt: skip
    return report


def _add(
    engine: LLMEngine, report: WarmupReport, prompt: list[int], params: SamplingParams
) -> None:
    engine.add_request(f"warmup-{report.requests}", prompt, params)
    report.requests += 1


def _step(engine: LLMEngine, report: WarmupReport, on_step: Callable[[], None] | None) -> None:
    engine.step()
    report.steps += 1
    if on_step is not None:
        on_step()


def _drain(engine: LLMEngine, report: WarmupReport, on_step: Callable[[], None] | None) -> None:
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        _step(engine, report, on_step)
    raise RuntimeError("warm-up did not finish")


def _run(
    engine: LLMEngine,
    report: WarmupReport,
    on_step: Callable[[], None] | None,
    classes: list[str],
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
) -> None:
    for i, prompt in enumerate(prompts):
        _add(engine, report, prompt, params[i] if isinstance(params, list) else params)
    _drain(engine, report, on_step)
    report.shape_classes += classes


def _run_mixed(
    engine: LLMEngine,
    report: WarmupReport,
    on_step: Callable[[], None] | None,
    prompt: list[int],
    params: SamplingParams,
) -> None:
    """One request decoding while a second one's prompt is computed in the same step."""
    _add(engine, report, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    _step(engine, report, on_step)
    _add(engine, report, list(reversed(prompt)), params)
    _drain(engine, report, on_step)
    report.shape_classes.append("mixed")


def _forget(engine: LLMEngine) -> None:
    """Back to a fresh engine's state: no cached hash, zeroed counters."""
    pool = engine.kv.pool
    if not pool.reset_prefix_cache():
        raise RuntimeError("warm-up left blocks held")
    engine.reset_counters()
