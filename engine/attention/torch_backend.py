"""Attention in plain PyTorch: the CPU path and the reference for every other backend.

Decodes are batched into one SDPA call over a padded gather of their blocks, with the query
heads of a KV group laid out as query rows (no K/V repetition for GQA). Prefills run one SDPA call
per sequence. A prefill chunk that follows cached or earlier-computed context needs a causal mask
aligned to the *bottom right* (query ``i`` sees keys ``0 .. ctx - qlen + i``); SDPA's
``is_causal=True`` is aligned top-left, so it is only used when the chunk is the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        if nd == 0:
            return
        lens = meta.seq_lens[:nd]
        max_len = int(max(meta.seq_lens_list[:nd]))
        num_blocks = -(-max_len // meta.block_size)
        meta.extra["decode_block_tables"] = meta.block_tables[:nd, :num_blocks]
        span = num_blocks * meta.block_size
        keep = torch.arange(span, device=lens.device)[None, :] < lens[:, None]
        meta.extra["decode_mask"] = keep[:, None, None, :]

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
        self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            self.decode_forward(q, k_cache, v_cache, meta, scale, out)
        self.prefill_forward(q, k, v, k_cache, v_cache, meta, scale, out)
        return out

    def decode_forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the one-token decode sequences ``[0, num_decodes)`` into ``out``."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        nd = meta.num_decodes
        tables = meta.extra["decode_block_tables"]
        span = tables.shape[1] * block_size
        flat = tables.reshape(-1)
        kk = k_cache.index_select(0, flat).view(nd, span, num_kv_heads, head_dim).transpose(1, 2)
        vv = v_cache.index_select(0, flat).view(nd, span, num_kv_heads, head_dim).transpose(1, 2)
        qq = q[:nd].view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=meta.extra["decode_mask"], scale=scale
        )
        out[:nd] = o.reshape(nd, num_heads, head_dim)

    def prefill_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the prefill sequences ``[num_decodes, num_seqs)`` into ``out``, one SDPA
        call each (their K/V must already be in the cache)."""
        for i in range(meta.num_decodes, meta.num_seqs):
            self.prefill_one(q, k, v, k_cache, v_cache, meta, scale, out, i)

    @staticmethod
    def prefill_one(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        i: int,
    ) -> None:
        """Attention of sequence ``i``'s query tokens into ``out``: over the chunk's own K/V when
        the chunk is the whole context, else over the context gathered from the cache."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        qlen = end - start
        ctx = meta.seq_lens_list[i]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)
        if ctx == qlen:
            ki = k[start:end].transpose(0, 1).unsqueeze(0)
            vi = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            nb = -(-ctx // block_size)
            ids = meta.block_tables[i, :nb]
            # index_select: several times faster than advanced indexing for a gather of rows.
            ki = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:ctx]
            vi = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:ctx]
            ki = ki.transpose(0, 1).unsqueeze(0)
            vi = vi.transpose(0, 1).unsqueeze(0)
            rows = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o.squeeze(0).transpose(0, 1)
