"""Chained hashes of full KV blocks: the one identity of a prefix, shared by every process.

The engine's prefix cache, the router in the ingress process and the KV directory all key blocks by
these hashes, so they must be identical across processes and machines. Python's ``hash()`` is
salted per process, so we hash canonical bytes with BLAKE2b instead:

    H(block i) = blake2b_64(H(block i-1) as 8 little-endian bytes | token ids as u32 little-endian)
    H(block 0) = blake2b_64(blake2b_64(salt) | token ids ...)

The salt (normally the model name) keeps different models' blocks apart; a request's
``cache_salt`` extends it (``salted``), so requests with different cache salts never share a block
in any engine's cache, in routing or through KV sharing. Only *full* blocks are hashed: a
partially filled block has no hash and can never be shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int

_ROOTS: dict[str, bytes] = {}


def _root(salt: str) -> bytes:
    root = _ROOTS.get(salt)
    if root is None:
        root = hashlib.blake2b(b"prefixserve/v1:" + salt.encode(), digest_size=8).digest()
        _ROOTS[salt] = root
    return root


def salted(salt: str, cache_salt: str | None) -> str:
    """The hash salt of a request with ``cache_salt`` (vLLM's request field of that name) on an
    engine whose salt is ``salt``; no cache salt leaves it as it is."""
    return salt if cache_salt is None else f"{salt}\x00cache_salt:{cache_salt}"


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], salt: str = ""
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    prefix = _root(salt) if parent is None else parent.to_bytes(8, "little")
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.blake2b(prefix + payload, digest_size=8).digest(), "little")


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str = ""
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order."""
    return extend_block_hashes([], token_ids, block_size, salt)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str = ""
) -> list[BlockHash]:
    """Append to ``hashes`` (the hashes of the first ``len(hashes)`` blocks of ``token_ids``) the
    hashes of the blocks that have since become full. Returns ``hashes``."""
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
