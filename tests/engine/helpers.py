"""Helpers shared by the engine tests."""

from __future__ import annotations

import random
from pathlib import Path

from engine import EngineConfig, LLMEngine

# Enough for every test here; the default (1 GiB of KV) costs a second to allocate per engine.
NUM_KV_BLOCKS = 256


def make_engine(model_dir: Path | str, **options: object) -> LLMEngine:
    options.setdefault("dtype", "float32")
    options.setdefault("num_kv_blocks", NUM_KV_BLOCKS)
    return LLMEngine(EngineConfig(model=str(model_dir), **options))  # type: ignore[arg-type]


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    """``n`` ids in ``[3, vocab)``, so never one of the tiny models' special tokens 0..2."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]
