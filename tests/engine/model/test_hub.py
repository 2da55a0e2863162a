"""Models and tokenizers named by Hugging Face hub id, served offline from a hub cache laid out
as huggingface_hub lays it out (no hub is reachable from the tests)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model import hub
from engine.model.loader import resolve_model, resolve_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, source: Path) -> Path:
    """Put ``source``'s files into ``cache`` as a snapshot of ``repo_id`` on ``main``: content-
    addressed blobs, a snapshot folder of symlinks to them, and ``refs/main``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_and_paths_are_told_apart():
    assert hub.is_repo_id("Qwen/Qwen3-0.6B") and hub.is_repo_id("google/gemma-3-1b-it")
    for name in ("smollm2-135m-instruct", "a/b/c", "/abs/dir", "./x/y", "a/../b", "a--b/c", ""):
        assert not hub.is_repo_id(name), name


def test_a_cached_hub_model_serves_offline(offline_cache, tiny_llama):
    snap = cache_repo(offline_cache, "acme/tiny-llama", tiny_llama)
    assert hub.offline()
    assert resolve_model("acme/tiny-llama") == snap
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 200, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    from_hub = LLM(model="acme/tiny-llama", dtype="float32", num_kv_blocks=32)
    from_dir = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=32)
    assert [o.token_ids for o in from_hub.generate(prompts, params)] == [
        o.token_ids for o in from_dir.generate(prompts, params)
    ]
    assert from_hub.engine.model_dir == snap


def test_an_uncached_hub_model_is_an_error_naming_the_field(offline_cache):
    with pytest.raises(ValueError, match="^model: 'acme/absent'.*hub cache"):
        resolve_model("acme/absent")


def test_a_snapshot_without_config_is_an_error(offline_cache, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "README.md").write_text("no weights here")
    cache_repo(offline_cache, "acme/empty", tmp_path / "src")
    with pytest.raises(ValueError, match="^model: .*no config.json"):
        resolve_model("acme/empty")


def test_tokenizer_by_hub_id_from_the_cache(offline_cache, tiny_llama, tiny_llama_with_tokenizer):
    tok_src = offline_cache.parent / "tok"
    tok_src.mkdir()
    for f in tiny_llama_with_tokenizer.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, tok_src / f.name)
    cache_repo(offline_cache, "acme/tokenizer", tok_src)
    tok = resolve_tokenizer("acme/tokenizer", tiny_llama)
    assert tok is not None and len(tok) == 49152


def test_a_given_tokenizer_must_exist_and_hold_one(tiny_llama, tmp_path, offline_cache):
    # No explicit tokenizer: the model's own, or None (token-id prompts only).
    assert resolve_tokenizer(None, tiny_llama) is None
    with pytest.raises(ValueError, match="^tokenizer: .*not a directory"):
        resolve_tokenizer(str(tmp_path / "missing" / "dir"), tiny_llama)
    with pytest.raises(ValueError, match="^tokenizer: .*no tokenizer files"):
        resolve_tokenizer(str(tiny_llama), tiny_llama)
    with pytest.raises(ValueError, match="^tokenizer: 'acme/absent'"):
        resolve_tokenizer("acme/absent", tiny_llama)
    with pytest.raises(ValueError, match="^tokenizer:"):
        LLM(model=str(tiny_llama), tokenizer=str(tmp_path / "missing"), num_kv_blocks=8)


def test_the_app_reports_a_missing_tokenizer_when_it_is_built(tiny_llama, tmp_path):
    from deployments.config import AppArgs
    from deployments.validation import RequestValidator

    args = AppArgs.model_validate({"model": str(tiny_llama), "tokenizer": str(tmp_path / "no")})
    with pytest.raises(ValueError, match="^tokenizer:"):
        RequestValidator(args)
