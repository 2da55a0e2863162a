"""Attention in plain PyTorch: the CPU path and the reference for every other backend.

Decodes are batched into one SDPA call over a padded gather of their blocks, with the query
heads of a KV group laid out as query rows (no K/V repetition for GQA). Prefills run one SDPA call
per sequence. A prefill chunk that follows cached or earlier-computed context needs a causal mask
aligned to the *bottom right* (query ``i`` sees keys ``0 .. ctx - qlen + i``); SDPA's
``is_causal=True`` is aligned top-left, so it is only used when the chunk is the whole context.

Sliding-window layers (``window``: a query at position ``p`` sees keys ``p - window + 1 .. p``)
and tanh soft-capping of the scores (``softcap``) are options of :meth:`forward`; the cache keeps
every position's K/V either way, so a prefix-cache hit serves windowed layers unchanged, and the
window only narrows what a query reads: a windowed layer gathers only the blocks that hold its
queries' windows. Soft-capping has no SDPA kernel: those layers compute
the scores explicitly, as transformers' eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, AttentionPlan


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA over ``q [..., Hkv, rows, D]`` and ``k``/``v [..., Hkv, keys, D]`` (``mask``: True
    where a row may see a key; None: no mask), or with ``softcap`` transformers' eager order:
    scores scaled, capped, masked, softmax in float32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@dataclass
class TorchAttentionPlan(AttentionPlan):
    """The decodes' padded gather, made once per step.

    With ``nd = num_decodes > 0`` and ``n = cdiv(max decode seq_len, block_size)``:
    ``decode_block_tables`` is ``[nd, n]``, the first ``n`` columns of the decodes' block
    tables, and ``decode_mask`` is ``[nd, 1, 1, n * block_size]``, True exactly at the key
    positions below the decode's ``seq_len``. Both are None when the step has no decode.
    ``decode_windows[w]`` is the ``(tables, mask)`` pair of layers with sliding window ``w``
    (see ``TorchAttentionBackend._decode_view``), added by the first such layer of the step.
    """

    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def torch_plan(meta: AttentionMetadata) -> TorchAttentionPlan:
    """The reference backend's plan for the step laid out by ``meta``."""
    nd = meta.num_decodes
    if nd == 0:
        return TorchAttentionPlan()
    lens = meta.seq_lens[:nd]
    max_len = int(max(meta.seq_lens_list[:nd]))
    num_blocks = -(-max_len // meta.block_size)
    span = num_blocks * meta.block_size
    keep = torch.arange(span, device=lens.device)[None, :] < lens[:, None]
    return TorchAttentionPlan(meta.block_tables[:nd, :num_blocks], keep[:, None, None, :])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_window = True
    supports_softcap = True

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = torch_plan(meta)

    def reference_plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        """The plan the decode path of this class reads; a subclass with a plan of its own
        says where its reference plan is."""
        return meta.plan_as(TorchAttentionPlan)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        # The whole step before any read: requests may read blocks others of the step write
        # (the invariant in AttentionBackend).
        self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if window is None and softcap is None:
            if meta.num_decodes:
                self.decode_forward(q, k_cache, v_cache, meta, scale, out)
            self.prefill_forward(q, k, v, k_cache, v_cache, meta, scale, out)
            return out
        if meta.num_decodes:
            self.decode_forward(q, k_cache, v_cache, meta, scale, out, window, softcap)
        for i in range(meta.num_decodes, meta.num_seqs):
            self.prefill_one(q, k, v, k_cache, v_cache, meta, scale, out, i, window, softcap)
        return out

    def _decode_view(
        self, meta: AttentionMetadata, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' block tables ``[nd, n]`` to gather and the mask ``[nd, 1, 1, n *
        block_size]`` of the keys each sees, made once per step and window. Windowed: only the
        blocks that hold a decode's last ``window`` positions, from its own first such block."""
        plan = self.reference_plan(meta)
        full, full_mask = plan.decode_block_tables, plan.decode_mask
        if full is None or full_mask is None:
            raise ValueError("the step has no decode to attend")
        if window is None:
            return full, full_mask
        if window not in plan.decode_windows:
            bs = meta.block_size
            lens = meta.seq_lens[: meta.num_decodes]
            # ``window`` consecutive positions touch at most this many blocks.
            n = min(full.shape[1], (window - 1) // bs + 2)
            first = (lens - window).clamp(min=0) // bs
            blocks = first[:, None] + torch.arange(n, device=lens.device)[None, :]
            tables = full.gather(1, blocks.clamp(max=full.shape[1] - 1))
            # Positions from the unclamped block numbers: a clamped repeat lies past the end.
            pos = (blocks[:, :, None] * bs + torch.arange(bs, device=lens.device)).flatten(1)
            keep = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
            plan.decode_windows[window] = (tables, keep[:, None, None, :])
        return plan.decode_windows[window]

    def decode_forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Attention of the one-token decode sequences ``[0, num_decodes)`` into ``out``."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        nd = meta.num_decodes
        tables, mask = self._decode_view(meta, window)
        span = tables.shape[1] * block_size
        flat = tables.reshape(-1)
        kk = k_cache.index_select(0, flat).view(nd, span, num_kv_heads, head_dim).transpose(1, 2)
        vv = v_cache.index_select(0, flat).view(nd, span, num_kv_heads, head_dim).transpose(1, 2)
        qq = q[:nd].view(nd, num_kv_heads, group, head_dim)
        o = attend(qq, kk, vv, mask, scale, softcap)
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
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Attention of sequence ``i``'s query tokens into ``out``: over the chunk's own K/V when
        the chunk is the whole context, else over the context gathered from the cache."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        qlen = end - start
        ctx = meta.seq_lens_list[i]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)
        if window is not None or softcap is not None:
            nb = -(-ctx // block_size)
            # The first key any query of the chunk sees, rounded down to its block.
            lo = max(0, ctx - qlen - window + 1) // block_size if window is not None else 0
            base = lo * block_size
            ids = meta.block_tables[i, lo:nb]
            ki = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[: ctx - base]
            vi = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[: ctx - base]
            group = q.shape[1] // num_kv_heads
            # Query heads of one KV head as rows: [1, Hkv, group * qlen, D], no K/V repeat.
            qg = qi.reshape(1, num_kv_heads, group * qlen, head_dim)
            ki = ki.transpose(0, 1).unsqueeze(0)
            vi = vi.transpose(0, 1).unsqueeze(0)
            rows = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            cols = torch.arange(base, ctx, device=q.device)[None, :]
            mask = cols <= rows
            if window is not None:
                mask &= cols > rows - window
            mask = mask.repeat(group, 1)
            o = attend(qg, ki, vi, mask, scale, softcap).reshape(1, q.shape[1], qlen, head_dim)
            out[start:end] = o.squeeze(0).transpose(0, 1)
            return
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
