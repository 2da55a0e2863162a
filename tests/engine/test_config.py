"""EngineConfig validation: every bad value raises a ValueError that names its field."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", ""),
        ("model", None),
        ("block_size", 0),
        ("block_size", -16),
        ("block_size", 16.0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("max_num_batched_tokens", True),
        ("num_kv_blocks", 0),
        ("num_kv_blocks", 2.5),
        ("max_model_len", 0),
        ("kv_cache_memory_gb", 0),
        ("kv_cache_memory_gb", "1"),
        ("watermark", 1.0),
        ("watermark", -0.1),
        ("watermark", None),
        ("dtype", "float64"),
        ("device", "tpu"),
        ("scheduling_policy", "lifo"),
        ("attention_backend", "xformers"),
        ("num_threads", 0),
        ("num_threads", 1.5),
        ("max_seqs_per_group", 0),
        ("max_seqs_per_group", 2.0),
        ("seed", "zero"),
        ("hash_salt", 3),
        ("tokenizer", 3),
        ("enable_prefix_caching", "yes"),
        ("async_scheduling", 1),
        ("enforce_eager", "no"),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**{field: value})


def test_defaults_are_valid_and_replace_revalidates():
    config = EngineConfig()
    assert config.model == "smollm2-135m-instruct"
    assert config.replace(block_size=32).block_size == 32
    with pytest.raises(ValueError, match="^block_size:"):
        config.replace(block_size=0)
