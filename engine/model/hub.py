"""Checkpoints named by Hugging Face hub id (``owner/name``), through ``huggingface_hub``.

A snapshot lands in huggingface_hub's own cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) and is reused from there: with ``HF_HUB_OFFLINE=1``, or when the
hub cannot be reached, a cached snapshot serves without any network call. Only the files the
engine reads are fetched (config, safetensors weights, tokenizer files, chat template); code in
a repository is never fetched nor run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a snapshot for the engine holds: configs, tokenizer configs, weights and their index,
# SentencePiece / BPE / tiktoken vocabularies, chat templates. Not *.bin, *.pt, *.gguf or *.py.
CHECKPOINT_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
)
TOKENIZER_PATTERNS = tuple(p for p in CHECKPOINT_PATTERNS if p != "*.safetensors")
# owner/name as the hub spells them; anything else is not a hub id (a typo'd path, say).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and "--" not in name


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as it is now, not as it was when
    huggingface_hub was imported."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or env.upper() in _TRUE


def snapshot(repo_id: str, field: str, patterns: tuple[str, ...]) -> Path:
    """The local directory of ``repo_id``'s snapshot (main revision), downloaded once; a
    ValueError naming ``field`` where there is none to be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=list(patterns),
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
            local_files_only=offline(),
        )
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"{field}: {repo_id!r} is not a local path, and the Hugging Face hub cache holds no "
            f"snapshot of it that can be used here ({e})"
        ) from e
    except (HfHubHTTPError, HFValidationError, OSError) as e:
        raise ValueError(
            f"{field}: could not fetch {repo_id!r} from the Hugging Face hub: {e}"
        ) from e
    return Path(path)
