"""The PyTorch attention backend against dense attention, on a batch mixing every case, with
and without sliding windows and soft-capping."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan

BS, HEADS, KV_HEADS, DIM, NUM_BLOCKS = 4, 4, 2, 8, 32


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q [qlen, H, D]`` over ``k``/``v [ctx, Hkv, D]``, causal mask aligned bottom-right;
    ``window``: a query sees only the last ``window`` positions up to its own; ``softcap``:
    scores -> softcap * tanh(scores / softcap)."""
    qlen, ctx = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keys, rows = torch.arange(ctx)[None, :], torch.arange(ctx - qlen, ctx)[:, None]
    visible = keys <= rows
    if window is not None:
        visible &= keys > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def mixed_batch(seqs: list[tuple[int, int]], num_decodes: int, gen: torch.Generator):
    """Paged caches holding each sequence's earlier context (garbage elsewhere), the step's
    q/k/v and its metadata; plus each sequence's blocks, full K/V and query rows."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    k_cache = torch.randn(NUM_BLOCKS, BS, KV_HEADS, DIM, generator=gen)  # garbage everywhere
    v_cache = torch.randn(NUM_BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    for ctx, qlen in seqs:
        blocks = [free.pop() for _ in range(-(-ctx // BS))]
        tables.append(blocks)
        k = torch.randn(ctx, KV_HEADS, DIM, generator=gen)
        v = torch.randn(ctx, KV_HEADS, DIM, generator=gen)
        full_k.append(k)
        full_v.append(v)
        for pos in range(ctx - qlen):  # the context computed in earlier steps
            k_cache[blocks[pos // BS], pos % BS] = k[pos]
            v_cache[blocks[pos // BS], pos % BS] = v[pos]

    q_parts, k_parts, v_parts, slots, qsl = [], [], [], [], [0]
    for (ctx, qlen), blocks, k, v in zip(seqs, tables, full_k, full_v, strict=True):
        q_parts.append(torch.randn(qlen, HEADS, DIM, generator=gen))
        k_parts.append(k[ctx - qlen :])
        v_parts.append(v[ctx - qlen :])
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx - qlen, ctx)]
        qsl.append(qsl[-1] + qlen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = [ctx for ctx, _ in seqs]
    meta = AttentionMetadata(
        num_tokens=qsl[-1],
        num_decodes=num_decodes,
        block_size=BS,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        block_tables=block_tables,
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc_list=qsl,
        seq_lens_list=seq_lens,
    )
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)
    return (q, k, v, k_cache, v_cache, meta), (tables, full_k, full_v, q_parts, qsl)


def test_mixed_batch_matches_dense_attention():
    gen = torch.Generator().manual_seed(0)
    # (context length, query length): two decodes, a chunk after cached context, a fresh prefill,
    # and a chunk that starts mid-block.
    seqs = [(5, 1), (9, 1), (12, 4), (7, 7), (11, 6)]
    step, (tables, full_k, full_v, q_parts, qsl) = mixed_batch(seqs, 2, gen)
    q, k, v, k_cache, v_cache, meta = step
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5)

    for i, (ctx, _) in enumerate(seqs):
        expected = dense_attention(q_parts[i], full_k[i], full_v[i])
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], expected, atol=1e-5, rtol=1e-5)
        # The new K/V landed in the request's slots.
        blocks = tables[i]
        cached_k = torch.stack([k_cache[blocks[p // BS], p % BS] for p in range(ctx)])
        cached_v = torch.stack([v_cache[blocks[p // BS], p % BS] for p in range(ctx)])
        torch.testing.assert_close(cached_k, full_k[i])
        torch.testing.assert_close(cached_v, full_v[i])


@pytest.mark.parametrize("window", [None, 1, 3, 4, 6, 9, 40])
@pytest.mark.parametrize("softcap", [None, 0.7])
def test_windows_and_soft_capping_match_dense_attention(window, softcap):
    """Windows shorter and longer than a block and than the contexts, in decodes (contexts that
    end on, before and past a block boundary) and in chunks after cached context."""
    gen = torch.Generator().manual_seed(1)
    seqs = [(4, 1), (13, 1), (17, 1), (2, 1), (20, 5), (9, 9), (23, 10)]
    step, (_, full_k, full_v, q_parts, qsl) = mixed_batch(seqs, 4, gen)
    q, k, v, k_cache, v_cache, meta = step
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    options = {"window": window, "softcap": softcap}
    out = backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5, **options)
    for i in range(len(seqs)):
        expected = dense_attention(q_parts[i], full_k[i], full_v[i], **options)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], expected, atol=1e-5, rtol=1e-5)
    if window is not None:
        # Decodes gather only the blocks that hold their windows.
        tables, _ = meta.plan_as(TorchAttentionPlan).decode_windows[window]
        assert tables.shape[1] == min(-(-17 // BS), (window - 1) // BS + 2)
