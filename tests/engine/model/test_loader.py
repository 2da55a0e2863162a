"""Finding checkpoints and loading their weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.config import model_config_from_hf
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    DEFAULT_MODEL,
    check_model,
    load_hf_config,
    load_safetensors,
    load_tokenizer,
    resolve_model,
)


def test_resolve_model(tiny_llama, tmp_path):
    assert resolve_model(str(tiny_llama)) == tiny_llama
    for bad in (str(tmp_path / "missing"), str(tmp_path), "not-a-known-model"):
        with pytest.raises(ValueError, match="^model:"):
            resolve_model(bad)


def test_tokenizer_is_optional(tiny_llama, tiny_llama_with_tokenizer):
    assert load_tokenizer(tiny_llama) is None
    tok = load_tokenizer(tiny_llama_with_tokenizer)
    assert tok is not None and len(tok) == 49152


def test_weights_must_exist(tmp_path):
    with pytest.raises(ValueError, match="^model: no"):
        load_safetensors(tmp_path)


def test_missing_weight_is_named(tiny_llama):
    hf_config, gen = load_hf_config(tiny_llama)
    cfg = model_config_from_hf(hf_config, gen)
    weights = load_safetensors(tiny_llama)
    del weights["model.layers.1.mlp.up_proj.weight"]
    model = LlamaForCausalLM(cfg, TorchAttentionBackend(), torch.float32)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        model.load_hf_weights(weights)


def test_default_model_resolves_to_its_converted_directory(smollm2_dir):
    assert resolve_model("smollm2-135m-instruct") == smollm2_dir
    assert (smollm2_dir / "config.json").is_file()
    assert (smollm2_dir / ".complete").is_file()


def test_check_model_accepts_every_form_without_converting(tiny_llama, tiny_llama_with_tokenizer):
    check_model(str(tiny_llama))
    check_model(str(tiny_llama), tokenizer=str(tiny_llama_with_tokenizer))
    check_model(DEFAULT_MODEL)  # its package is installed; nothing is converted here
    check_model("some-org/some-model")  # a hub id: left to the replicas, nothing downloaded


def test_check_model_names_the_field_of_each_problem(tiny_llama, tmp_path):
    unsupported = tmp_path / "unsupported"
    shutil.copytree(tiny_llama, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama / "config.json", no_weights / "config.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cases = {
        str(tmp_path / "missing"): "is neither",
        str(unsupported): "not supported",
        str(no_weights): "no \\*.safetensors",
        str(broken): "config.json",
    }
    for model, message in cases.items():
        with pytest.raises(ValueError, match=f"^model: .*{message}"):
            check_model(model)
    with pytest.raises(ValueError, match="^tokenizer: .*no tokenizer files"):
        check_model(str(tiny_llama), tokenizer=str(tiny_llama))  # weights, no tokenizer
    with pytest.raises(ValueError, match="^tokenizer: .*not a directory"):
        check_model(str(tiny_llama), tokenizer=str(tmp_path / "nothing" / "here"))
