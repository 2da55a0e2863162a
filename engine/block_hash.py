"""Chained hashes of full KV blocks: the one identity of a prefix, shared by every process.

The engine's prefix cache, the router in the ingress process and the KV directory all key blocks by
these hashes, so they must be identical across processes and machines. Python's ``hash()`` is
salted per process, so we hash canonical bytes with BLAKE2b-128 instead:

    root         = keyed_blake2b_128(key, "prefixserve/kv/v2" | namespace | cache salt)
    H(block 0)   = blake2b_128(root | token ids as u32 little-endian)
    H(block i)   = blake2b_128(H(block i-1) as 16 little-endian bytes | token ids ...)

Invariants:

* The *namespace* is the engine's KV fingerprint (``engine.kv_fingerprint``): everything that
  makes two engines' KV for the same tokens differ (weights, dtype, block size, KV layout, format
  version). Two blocks with the same hash therefore hold interchangeable KV, in any engine of any
  process that shares the key.
* The *key* is a per-application secret. Without it nobody can compute a hash offline, so a
  client cannot search for a prompt whose blocks collide with another tenant's (128 bits also
  put a blind collision out of reach). An engine with no key (offline use) hashes unkeyed.
* A request's ``cache_salt`` (vLLM's field) extends the root: requests with different cache salts
  never share a block in any engine's cache, in routing or through KV sharing.
* Only *full* blocks are hashed: a partially filled block has no hash and can never be shared.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

BlockHash = int
HASH_BYTES = 16
_TAG = b"prefixserve/kv/v2\x00"


def hash_key(secret: str | None) -> bytes:
    """The BLAKE2b key for an application secret of any length (None: unkeyed)."""
    return b"" if not secret else hashlib.sha256(secret.encode()).digest()


@functools.lru_cache(maxsize=4096)
def hash_root(namespace: str, key: bytes = b"", cache_salt: str | None = None) -> bytes:
    """The root every chain of ``namespace`` starts from, for requests with ``cache_salt``."""
    data = _TAG + namespace.encode()
    if cache_salt is not None:
        data += b"\x00cache_salt\x00" + cache_salt.encode()
    return hashlib.blake2b(data, key=key, digest_size=HASH_BYTES).digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], root: bytes | None = None
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    if parent is None:
        prefix = hash_root("") if root is None else root
    else:
        prefix = parent.to_bytes(HASH_BYTES, "little")
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    digest = hashlib.blake2b(prefix + payload, digest_size=HASH_BYTES).digest()
    return int.from_bytes(digest, "little")


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, root: bytes | None = None
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order."""
    return extend_block_hashes([], token_ids, block_size, root)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: bytes | None = None
) -> list[BlockHash]:
    """Append to ``hashes`` (the hashes of the first ``len(hashes)`` blocks of ``token_ids``) the
    hashes of the blocks that have since become full. Returns ``hashes``."""
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], root)
        hashes.append(parent)
    return hashes
