"""The GPU benchmark's CPU-runnable parts: parameter and KV arithmetic checked against
transformers and the engine, the floor formula, the checkpoint builder, and a CPU smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from benchmarks.gpu_model import (
    SHAPES,
    build_checkpoint,
    decode_step_floor,
    llama_config,
    mean_context_lengths,
)


def _meta_model(shape):
    """transformers' Llama of ``shape`` on the meta device: sizes without memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(llama_config(shape))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_count_matches_transformers(name):
    shape = SHAPES[name]
    model = _meta_model(shape)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    read = sum(p.numel() for p in model.parameters())
    if not shape.tie_word_embeddings:
        read -= embed  # gathered a few rows per step, not read in full
    assert shape.params_read_per_step() == read


def test_shapes_have_the_real_models_sizes():
    # The parameter counts of the published checkpoints' safetensors.
    assert SHAPES["smollm2-135m"].num_params() == 134_515_008
    assert SHAPES["llama-1b"].num_params() == 1_235_814_400


def test_checkpoint_loads_in_the_engine_with_its_shape(tmp_path):
    from engine.model.config import model_config_from_hf
    from engine.model.loader import load_hf_config

    shape = SHAPES["tiny"]
    path = build_checkpoint(shape, tmp_path, "bfloat16")
    cfg = model_config_from_hf(*load_hf_config(path))
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
    )
    assert cfg.vocab_size == shape.vocab_size
    # The engine's own KV size per token agrees with the floor's.
    assert cfg.kv_bytes_per_block(16, torch.bfloat16) == 16 * shape.kv_bytes_per_token("bfloat16")


def test_mean_context_is_the_average_over_decode_steps():
    prompts, n = [10, 37], 9
    brute = [sum(p + t for t in range(1, n)) / (n - 1) for p in prompts]
    assert mean_context_lengths(prompts, n) == pytest.approx(brute)


def test_decode_step_floor_adds_weights_kv_and_launches():
    shape = SHAPES["llama-1b"]
    floor = decode_step_floor(shape, "bfloat16", [1000.0, 3000.0], 2000.0, 300, 2.5)
    # Llama 3.2 1B: 1.236e9 parameters in bf16; 16 layers x 2 x 8 heads x 64 x 2 B = 32 KiB of KV
    # per token.
    assert floor.weight_bytes == shape.num_params() * 2
    assert floor.kv_bytes == 4000 * 32768
    assert floor.memory_ms == pytest.approx((floor.weight_bytes + 4000 * 32768) / 2e12 * 1e3)
    assert floor.launch_ms == pytest.approx(300 * 2.5e-3)
    assert floor.total_ms == pytest.approx(floor.memory_ms + 0.75)
    unknown = decode_step_floor(shape, "bfloat16", [1000.0], 2000.0)
    assert unknown.launch_ms is None and unknown.total_ms == unknown.memory_ms


def test_cpu_smoke_run_reports_every_row(tmp_path: Path):
    out_file = tmp_path / "gpu.json"
    out = gpu.main(["--device", "cpu", "--quick", "--shape", "tiny", "--out", str(out_file)])
    assert json.loads(out_file.read_text()) == json.loads(json.dumps(out))
    rows = {(r["workload"], r["engine"]): r for r in out["results"]}
    ours = {(w, "ours-eager") for w in ("w1", "long")}
    assert set(rows) == ours | {(w, "transformers") for w in ("w1", "long")}
    for key in ours:
        row = rows[key]
        # The per-step figure is a difference of two whole runs: on a tiny CPU model a few ms
        # of noise can outweigh it, so only its presence is checked; the engine's own measure
        # of the same step must be positive.
        assert row["tok_s"] > 0 and math.isfinite(row["decode_ms_per_step"])
        assert row["engine_decode_step_ms"] > 0
        hf = rows[(key[0], "transformers")]
        assert row["x_transformers"] == pytest.approx(row["tok_s"] / hf["tok_s"], rel=0.01)
        assert row["floor_ms"] == row["floor_memory_ms"] > 0
        assert row["kernels_per_step"] is None  # counted on CUDA only
    assert out["copy_bandwidth_GBps"] > 0


def test_a_failed_measurement_is_reported_and_the_run_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gpu, "run_hf", broken)
    out = gpu.main(["--device", "cpu", "--quick", "--shape", "tiny", "--workload", "w1"])
    ours, hf = out["results"]
    assert hf["engine"] == "transformers" and "out of memory" in hf["error"]
    assert ours["tok_s"] > 0 and "x_transformers" not in ours
