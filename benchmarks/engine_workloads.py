"""The offline engine workloads, as plain token-id lists (standard library only).

This module must import without torch or the engine: the vLLM comparison runs it inside vLLM's own
virtualenv, so both engines see exactly the same prompts.

* W1: ``n`` distinct prompts of 64-128 random tokens, ``128`` output tokens each.
* W2: ``n`` prompts sharing a 512-token prefix plus a distinct 32-token suffix, 64 output tokens.
* batch-1: one W1 prompt alone, 128 output tokens; reported as ms per output token after the first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def warmup(seed: int = 3) -> Workload:
    """A short run that touches prefill and decode paths before timing."""
    rng = random.Random(seed)
    return Workload("warmup", [_tokens(rng, 40 + 8 * i) for i in range(4)], 8, False)
