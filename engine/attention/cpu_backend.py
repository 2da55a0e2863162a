"""CPU attention: decodes through the native paged kernel, prefills through the PyTorch path.

Decode attention is bound by reading the KV cache: the PyTorch path gathers every decode
sequence's blocks into a padded copy (read, write, then read again by SDPA), while the native
kernel (``engine.attention.native``) reads each cached row once, straight through the block table.
Prefill chunks have many query rows per sequence, where SDPA's blocked kernels win, so they keep
the PyTorch path. Selected by ``attention_backend="cpu"``, or by ``auto`` on CPU when the kernel
builds; without a C compiler ``auto`` falls back to ``torch``.
"""

from __future__ import annotations

import torch

from engine.attention import native
from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        if not native.available():
            raise ValueError(
                "attention_backend: cpu needs the native kernel, which could not be built "
                "(no C compiler, or PREFIXSERVE_NATIVE_KERNELS=0)"
            )

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        if nd:
            # Contiguous copies the kernel reads through raw pointers.
            meta.extra["native_seq_lens"] = meta.seq_lens[:nd].contiguous()
            meta.extra["native_block_tables"] = meta.block_tables[:nd].contiguous()

    def decode_forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        nd = meta.num_decodes
        if q.dtype not in native.DTYPE_CODES:
            # float16 has no native path: the padded-gather reference handles it.
            if "decode_mask" not in meta.extra:
                super().prepare(meta)
            super().decode_forward(q, k_cache, v_cache, meta, scale, out)
            return
        native.paged_decode_attention(
            q[:nd],
            k_cache,
            v_cache,
            meta.extra["native_block_tables"],
            meta.extra["native_seq_lens"],
            out[:nd],
            scale,
        )
