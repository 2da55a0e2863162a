"""FlashAttention over the paged cache on CUDA, from whichever provider loads
(``engine.attention.flash_kernels``: ``vllm_flash_attn``, ``flash_attn`` or our Triton kernels).

A pure-decode step (every sequence has one query token) is one ``flash_attn_with_kvcache`` call
with ``q`` viewed ``[B, 1, H, D]``; any other step is one ``flash_attn_varlen_func`` call over
the whole flat batch, decodes and prefill chunks alike. Both read each sequence's KV straight
from the paged cache through ``block_table`` and align the causal mask to the bottom right.

The decode path is safe to capture in a CUDA graph (``supports_cuda_graphs``): ``prepare`` and
``forward`` launch only device work and read no Python value of the metadata but shapes and
``num_decodes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, AttentionPlan
from engine.attention.flash_kernels import FlashKernels, load_flash_kernels


@dataclass
class FlashAttentionPlan(AttentionPlan):
    """The kernels' int32 views of the step, on the batch's device: ``block_table [num_seqs,
    max_blocks]`` is ``block_tables`` and ``cache_seqlens [num_seqs]`` is ``seq_lens``. For a step
    that is not pure decode also ``cu_seqlens_q [num_seqs + 1]`` (``query_start_loc``) and
    ``cu_seqlens_k [num_seqs + 1]`` (0, then the running sum of ``seq_lens``); both are None on a
    pure-decode step, which needs neither."""

    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None


def is_pure_decode(meta: AttentionMetadata) -> bool:
    """Whether every sequence of the step has one query token, from ``num_decodes`` and a shape
    only (no host list, so a captured graph decides the same way)."""
    return meta.num_decodes == meta.seq_lens.shape[0]


def flash_plan(meta: AttentionMetadata, block_multiple: int = 16) -> FlashAttentionPlan:
    """The flash backend's plan for the step laid out by ``meta``; raises ValueError when the
    block size is not a multiple of ``block_multiple`` (the kernels' paged layout needs one)."""
    if meta.block_size % block_multiple:
        raise ValueError(f"block_size: the flash kernels need a multiple of {block_multiple}")
    plan = FlashAttentionPlan(
        block_table=meta.block_tables.to(torch.int32),
        cache_seqlens=meta.seq_lens.to(torch.int32),
    )
    if not is_pure_decode(meta):
        num_seqs = meta.seq_lens.shape[0]
        cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        plan.cu_seqlens_q = meta.query_start_loc.to(torch.int32)
        plan.cu_seqlens_k = cu_k
    return plan


class FlashAttentionBackend(AttentionBackend):
    name = "flash"
    supports_cuda_graphs = True

    def __init__(self, kernels: FlashKernels | None = None) -> None:
        """``kernels``: the provider to run (tests force one); None: the first that loads."""
        found = kernels or load_flash_kernels()
        if found is None:
            raise ValueError("no flash kernel provider loads")
        self.kernels = found

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = flash_plan(meta, self.kernels.block_multiple)

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
        # Queued before the kernel on the same stream: requests may read blocks others of the
        # step write (the invariant in AttentionBackend).
        self.write_kv(k, v, k_cache, v_cache, meta)
        if plan.cu_seqlens_q is None or plan.cu_seqlens_k is None:
            out = self.kernels.with_kvcache(
                q=q.unsqueeze(1),
                k_cache=k_cache,
                v_cache=v_cache,
                cache_seqlens=plan.cache_seqlens,
                block_table=plan.block_table,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        return self.kernels.varlen(
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
