"""flash-attention's paged varlen kernel (``vllm_flash_attn``) on CUDA.

One call covers the whole flat batch, decodes and prefill chunks alike: the kernel reads each
sequence's KV straight from the paged cache through ``block_table`` (``cu_seqlens_k`` then gives
the context lengths) and aligns the causal mask to the bottom right. Needs fp16/bf16 and a block size that is a multiple of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, AttentionPlan


@dataclass
class FlashAttentionPlan(AttentionPlan):
    """The kernel's int32 views of the step, on the batch's device: ``cu_seqlens_q [num_seqs +
    1]`` is ``query_start_loc``; ``cu_seqlens_k [num_seqs + 1]`` starts at 0 and adds each
    sequence's context length (``seq_lens``); ``block_table [num_seqs, max_blocks]`` is
    ``block_tables``."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_table: torch.Tensor


def flash_plan(meta: AttentionMetadata) -> FlashAttentionPlan:
    """The flash backend's plan for the step laid out by ``meta``; raises ValueError when the
    block size is not a multiple of 16 (the kernel's paged layout needs one)."""
    if meta.block_size % 16:
        raise ValueError("block_size: the flash backend needs a multiple of 16")
    cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
    torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
    return FlashAttentionPlan(
        cu_seqlens_q=meta.query_start_loc.to(torch.int32),
        cu_seqlens_k=cu_k,
        block_table=meta.block_tables.to(torch.int32),
    )


class FlashAttentionBackend(AttentionBackend):
    name = "flash"

    def __init__(self) -> None:
        from vllm_flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = flash_plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = meta.plan_as(FlashAttentionPlan)
        self.write_kv(k, v, k_cache, v_cache, meta)
        return self._varlen(
            q=q,
            k=k_cache,
            v=v_cache,
            cu_seqlens_q=plan.cu_seqlens_q,
            max_seqlen_q=meta.max_query_len,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=plan.block_table,
        )
