"""``args.engine`` is EngineConfig's own declaration: the same options, defaults and bounds, so
that the application and the engine accept and refuse the same values."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from deployments.config import NOT_ENGINE_ARGS, AppArgs, EngineArgs
from engine.config import EngineConfig


def test_engine_args_are_the_engine_configs_fields_and_defaults() -> None:
    fields = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in NOT_ENGINE_ARGS]
    assert list(EngineArgs.model_fields) == fields
    defaults = EngineConfig()
    for name in fields:
        assert getattr(EngineArgs(), name) == getattr(defaults, name), name
    # The excluded fields are ones the application sets, or the engine's own.
    assert {f.name for f in dataclasses.fields(EngineConfig)} > NOT_ENGINE_ARGS
    assert {"model", "tokenizer", "kv_hash_key"} <= set(AppArgs.model_fields)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("block_size", 0),
        ("num_kv_blocks", 0),
        ("kv_cache_memory_gb", 0.0),
        ("max_num_seqs", -1),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 0),
        ("max_seqs_per_group", 0),
        ("num_threads", 0),
        ("watermark", 1.0),
        ("watermark", -0.01),
        ("dtype", "float64"),
        ("device", "tpu"),
        ("scheduling_policy", "lifo"),
        ("attention_backend", "xformers"),
        ("enable_prefix_caching", "maybe"),
    ],
)
def test_a_value_the_engine_refuses_is_refused_under_its_engine_key(name: str, value: object):
    with pytest.raises(ValueError, match=f"^{name}:"):
        EngineConfig(**{name: value})
    with pytest.raises(ValidationError) as exc:
        AppArgs.model_validate({"engine": {name: value}})
    assert exc.value.errors()[0]["loc"] == ("engine", name)


@pytest.mark.parametrize(
    ("name", "value"),
    [("watermark", 0.0), ("watermark", 0.99), ("num_threads", 1), ("attention_backend", "cpu")],
)
def test_a_value_the_engine_takes_is_taken_and_reaches_it(name: str, value: object) -> None:
    assert getattr(EngineConfig(**{name: value}), name) == value
    args = AppArgs.model_validate({"engine": {name: value}})
    assert getattr(args.engine_config(), name) == value


def test_engine_config_carries_every_engine_arg_and_the_top_level_ones() -> None:
    changed = {
        "dtype": "float32",
        "device": "cpu",
        "block_size": 32,
        "num_kv_blocks": 100,
        "kv_cache_memory_gb": 0.5,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 1024,
        "enable_prefix_caching": False,
        "scheduling_policy": "priority",
        "reject_late_requests": True,
        "max_seqs_per_group": 2,
        "watermark": 0.1,
        "adaptive_watermark": False,
        "async_scheduling": True,
        "enforce_eager": True,
        "attention_backend": "torch",
        "num_threads": 3,
        "seed": 7,
    }
    assert set(changed) == set(EngineArgs.model_fields)
    args = AppArgs.model_validate(
        {"model": "m", "tokenizer": "t", "kv_hash_key": "k" * 16, "engine": changed}
    )
    config = args.engine_config()
    assert {name: getattr(config, name) for name in changed} == changed
    assert (config.model, config.tokenizer, config.kv_hash_key) == ("m", "t", "k" * 16)
    # num_threads unset: the replica's CPU count fills it.
    unset = AppArgs.model_validate({"model": "m"}).engine_config(num_threads=5)
    assert unset.num_threads == 5
