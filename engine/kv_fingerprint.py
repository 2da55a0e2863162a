"""The KV fingerprint: what two engines must agree on for one's KV blocks to be valid in the other.

It names the model's content (not its name: a rolling update may swap weights under the same
name), the resolved dtype (``dtype: auto`` resolves per host), the block size, the KV layout
(layers, KV heads, head dim) and the exported block format's version. It is the namespace of every
block hash (``engine.block_hash.hash_root``), so blocks of engines with different fingerprints
never share a hash, in a prefix cache, a router or the KV directory.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

# Bump when the layout of exported blocks (engine.kv_transfer) changes.
KV_FORMAT_VERSION = 1
# Weight files up to this size are hashed whole; larger ones by sampled chunks (below).
_WHOLE_FILE_BYTES = 64 << 20
_CHUNK_BYTES = 64 << 10
_NUM_CHUNKS = 64


def _file_digest(path: Path, h: hashlib._Hash) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\x00{size}\x00".encode())
    with path.open("rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return
        # Evenly spaced chunks, the first (a safetensors header) and the last included: any
        # retraining or re-quantization changes nearly every byte, so samples see it, at a cost
        # that does not grow with the model.
        step = (size - _CHUNK_BYTES) // (_NUM_CHUNKS - 1)
        for i in range(_NUM_CHUNKS):
            f.seek(i * step)
            h.update(f.read(_CHUNK_BYTES))


def model_digest(model_dir: Path) -> str:
    """SHA-256 over the model directory's config and weight files (names, sizes and content)."""
    h = hashlib.sha256()
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    for path in files:
        if path.is_file():
            _file_digest(path, h)
    return h.hexdigest()


def kv_fingerprint(
    model_digest: str,
    dtype: torch.dtype,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> str:
    """A readable string naming everything the KV of one block depends on besides its tokens."""
    return (
        f"kv-format={KV_FORMAT_VERSION};model={model_digest[:32]};"
        f"dtype={str(dtype).removeprefix('torch.')};block={block_size};"
        f"layers={num_layers};kv_heads={num_kv_heads};head_dim={head_dim};"
        f"byteorder={sys.byteorder}"
    )
