"""Session-wide fixtures: tiny random checkpoints and the default model's converted directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.helpers import make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads), no tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model converted to a Hugging Face directory (cached across runs)."""
    from engine.model.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama that uses SmolLM2's tokenizer and vocabulary (49152 tokens)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-tok"),
        vocab_size=49152,
        tokenizer_from=smollm2_dir,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    """SmolLM2's tokenizer (fast, byte-level BPE)."""
    from engine.model.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
