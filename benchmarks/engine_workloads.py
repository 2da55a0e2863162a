"""The offline engine workloads, as plain token-id lists (standard library only).

This module must import without torch or the engine: the vLLM comparison runs it inside vLLM's own
virtualenv, so both engines see exactly the same prompts.

* W1: ``n`` distinct prompts of 64-128 random tokens, ``128`` output tokens each.
* W2: ``n`` prompts sharing a 512-token prefix plus a distinct 32-token suffix, 64 output tokens.
* batch-1: one W1 prompt alone, 128 output tokens; reported as ms per output token after the first.
* wave: a cold burst of 20 distinct prompts of 100 tokens, one output token each (a serving
  benchmark's wave of concurrent random prompts: one prefill step of 2,000 tokens); reported as
  ms for the wave, which sets a served burst's time to first token.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

# Workloads reported as a latency (lower is better): the key of their result and its unit.
LATENCY_METRICS = {"batch1": ("ms_per_token", "ms/token"), "wave": ("wave_ms", "ms")}

# Token ids are drawn above the special and byte-level tokens of SmolLM2's vocabulary.
LOW_TOKEN = 100
HIGH_TOKEN = 49152


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    prefix_caching: bool

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN, HIGH_TOKEN) for _ in range(n)]


def w1(num_prompts: int = 64, max_tokens: int = 128, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randint(64, 128)) for _ in range(num_prompts)]
    return Workload("w1", prompts, max_tokens, prefix_caching=False)


def w2(
    num_prompts: int = 64,
    max_tokens: int = 64,
    prefix_len: int = 512,
    suffix_len: int = 32,
    seed: int = 1,
) -> Workload:
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    prompts = [prefix + _tokens(rng, suffix_len) for _ in range(num_prompts)]
    return Workload("w2", prompts, max_tokens, prefix_caching=True)


def batch1(max_tokens: int = 128, seed: int = 2) -> Workload:
    rng = random.Random(seed)
    return Workload("batch1", [_tokens(rng, 100)], max_tokens, prefix_caching=False)


def wave(num_prompts: int = 20, prompt_len: int = 100, seed: int = 4) -> Workload:
    rng = random.Random(seed)
    return Workload("wave", [_tokens(rng, prompt_len) for _ in range(num_prompts)], 1, False)


def warmup(seed: int = 3) -> Workload:
    """A short run that touches prefill and decode paths before timing."""
    rng = random.Random(seed)
    return Workload("warmup", [_tokens(rng, 40 + 8 * i) for i in range(4)], 8, False)


def by_name(name: str, num_prompts: int = 64) -> Workload:
    if name == "w1":
        return w1(num_prompts)
    if name == "w2":
        return w2(num_prompts)
    if name == "batch1":
        return batch1()
    if name == "wave":
        return wave()
    raise ValueError(f"unknown workload {name!r}")


def measure_once(name: str, generate: Callable[[Workload, int], float], num_prompts: int) -> dict:
    """One timed run of a workload through ``generate(workload, max_tokens) -> seconds``. W1/W2:
    output tokens/s. batch-1: ms per output token after the first, from one 1-token run and one
    full run (``t(128) - t(1)``). wave: ms for the whole burst."""
    work = by_name(name, num_prompts)
    if name == "wave":
        return {"wave_ms": round(generate(work, work.max_tokens) * 1000, 1)}
    if name == "batch1":
        first = generate(work, 1)
        full = generate(work, work.max_tokens)
        return {
            "ms_per_token": round((full - first) / (work.max_tokens - 1) * 1000, 2),
            "ttft_ms": round(first * 1000, 1),
        }
    seconds = generate(work, work.max_tokens)
    return {"tok_s": round(work.num_output_tokens / seconds, 1), "seconds": round(seconds, 3)}


def serve_commands(generate: Callable[[Workload, int], float], num_prompts: int) -> None:
    """The child side of an interleaved comparison (``benchmarks.compare_vllm``): print ``READY``,
    then for every workload name read from stdin run it once and print ``RESULT {json}``; stop at
    end of input. The engine stays loaded between runs, so two engines can take turns."""
    print("READY", flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name:
            print("RESULT " + json.dumps(measure_once(name, generate, num_prompts)), flush=True)
