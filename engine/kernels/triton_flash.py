"""FlashAttention over a paged KV cache, written in Triton: the subset of the ``flash_attn`` /
``vllm_flash_attn`` call interface the flash backend uses.

The algorithm is FlashAttention's: one pass over the keys in tiles of ``BLOCK_N``, an online
softmax (running row max ``m``, running denominator ``l``) and an fp32 accumulator, all in base 2
(``qk_scale`` folds ``log2(e)`` into the softmax scale). Key ``j`` of a sequence lives in page
``block_table[j // block_size]`` at slot ``j % block_size``: a key tile gathers its pages through
the block table, so the tile width is independent of the page size (any block size works).

Grouped-query attention: one program handles one KV head and every query head that reads it.
Its rows are ``(token, head-in-group)`` pairs (``GROUP_PAD`` rows per token), so a K/V tile is
loaded once for the whole group and the products are ``tl.dot`` calls of at least 16 rows.

Two entry points:

* :func:`flash_attn_varlen_func` -- grid ``(query tiles, sequences, KV heads)``; the causal mask is
  aligned to the bottom right (query ``t`` of a sequence with ``q_len`` queries and ``k_len``
  keys sees keys ``<= k_len - q_len + t``), and a tile stops at the last key its rows may see.
* :func:`flash_attn_with_kvcache` -- decode (and short multi-token) steps, safe to capture in a
  CUDA graph: grid and constexprs come from tensor shapes only, nothing is read back to the host.
  Split-K: ``num_splits`` programs per (sequence, KV head) each take a contiguous share of the
  keys and write a partial ``(m, l, acc)``; a second kernel merges the shares.

Inputs: fp16, bf16 or fp32 (fp32 is for the CPU interpreter, ``TRITON_INTERPRET=1``); the last
dimension of q and of the caches must be contiguous. Head dims that are not a power of two are
padded to one with masks (at least 16, as ``tl.dot`` needs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Rows (token x head-in-group pairs) per program: tl.dot needs at least 16; 64 keeps the fp32
# accumulator of a 128-wide head within one warp group's registers.
MIN_ROWS = 16
MAX_ROWS = 64
# Keys per tile.
BLOCK_N = 64
# Split-K for decode: aim for this many programs in flight (an H100 has 132 SMs), give each split
# at least SPLIT_MIN_KEYS keys of the longest context a block table can hold, and never more
# than MAX_SPLITS (the merge loads all splits at once).
TARGET_PROGRAMS = 256
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 32


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    table_row_ptr,
    key_base,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    row_limit,
    lo,
    hi,
    qk_scale,
    offs_d,
    d_ok,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Fold keys ``[lo, hi)`` into the online softmax state ``(acc, m_i, l_i)`` of the rows
    ``q [R, D]``; a row sees key ``j`` only when ``j <= row_limit[row]``. ``k_ptr``/``v_ptr``
    already point at the KV head; paged: key ``j`` is at page ``table_row_ptr[j // PAGE]``, slot
    ``j % PAGE``; else at row ``key_base + j`` (``stride_ks`` apart)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < hi
        if PAGED:
            page = tl.load(table_row_ptr + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
            slot = (keys % PAGE).to(tl.int64)
            k_off = page * stride_kb + slot * stride_ks
            v_off = page * stride_vb + slot * stride_vs
        else:
            row = (key_base + keys).to(tl.int64)
            k_off = row * stride_ks
            v_off = row * stride_vs
        kt = tl.load(
            k_ptr + k_off[None, :] + offs_d[:, None],
            mask=key_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, kt) * qk_scale
        visible = key_ok[None, :] & (keys[None, :] <= row_limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        # m_i starts finite (-1e30), so a row with no visible key yet gives exp2(-inf) = 0, never
        # exp2(nan).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(
            v_ptr + v_off[:, None] + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_q_ptr,
    cu_k_ptr,
    used_k_ptr,
    table_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    qk_scale,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_USED_K: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    if HAS_USED_K:
        k_len = tl.load(used_k_ptr + seq)
    else:
        k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    key_base = tl.load(cu_k_ptr + seq)  # read only when not PAGED

    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    m = offs_r // GROUP_PAD
    h = offs_r % GROUP_PAD
    tok = tile * BLOCK_M + m
    row_ok = (m < BLOCK_M) & (tok < q_len) & (h < GROUP)
    head = (kvh * GROUP + h).to(tl.int64)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if CAUSAL:
        row_limit = k_len - q_len + tok
        hi = tl.minimum(k_len, k_len - q_len + (tile + 1) * BLOCK_M)
    else:
        row_limit = tl.zeros([BLOCK_R], dtype=tl.int32) + (k_len - 1)
        hi = k_len

    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        k_ptr + kvh.to(tl.int64) * stride_kh,
        v_ptr + kvh.to(tl.int64) * stride_vh,
        table_ptr + seq.to(tl.int64) * stride_tb,
        key_base,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        row_limit,
        0,
        hi,
        qk_scale,
        offs_d,
        d_ok,
        BLOCK_N,
        PAGE,
        PAGED,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seqlens_ptr,
    table_ptr,
    acc_ptr,
    ml_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    qk_scale,
    head_dim,
    ml_size,
    SQ: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    M_TILES: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """One split of one (sequence, query tile, KV head): partial ``acc [R, D]`` and ``(m, l)``
    into the scratch buffers ``acc [B, SQ, H, NUM_SPLITS, D]`` and ``ml [2, B, SQ, H,
    NUM_SPLITS]`` (fp32, contiguous; ``ml_size`` elements per half)."""
    pid = tl.program_id(0)
    seq = pid // M_TILES
    tile = pid % M_TILES
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    k_len = tl.load(seqlens_ptr + seq)

    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    m = offs_r // GROUP_PAD
    h = offs_r % GROUP_PAD
    tok = tile * BLOCK_M + m
    row_ok = (m < BLOCK_M) & (tok < SQ) & (h < GROUP)
    head = (kvh * GROUP + h).to(tl.int64)
    q = tl.load(
        q_ptr
        + seq.to(tl.int64) * stride_qb
        + tok[:, None].to(tl.int64) * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if CAUSAL:
        row_limit = k_len - SQ + tok
        tile_hi = tl.minimum(k_len, k_len - SQ + (tile + 1) * BLOCK_M)
    else:
        row_limit = tl.zeros([BLOCK_R], dtype=tl.int32) + (k_len - 1)
        tile_hi = k_len
    tile_hi = tl.maximum(tile_hi, 0)
    # Each split takes a whole number of key tiles; the last splits may get none.
    per_split = tl.cdiv(tl.cdiv(tile_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(tile_hi, lo + per_split)

    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        k_ptr + kvh.to(tl.int64) * stride_kh,
        v_ptr + kvh.to(tl.int64) * stride_vh,
        table_ptr + seq.to(tl.int64) * stride_tb,
        0,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        row_limit,
        lo,
        hi,
        qk_scale,
        offs_d,
        d_ok,
        BLOCK_N,
        PAGE,
        True,
    )
    # Index of (seq, tok, head, split) in [B, SQ, H, NUM_SPLITS].
    part = ((seq.to(tl.int64) * SQ + tok.to(tl.int64)) * NUM_HEADS + head) * NUM_SPLITS + split
    tl.store(
        acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
        acc,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(ml_ptr + part, m_i, mask=row_ok)
    tl.store(ml_ptr + ml_size + part, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(
    acc_ptr,
    ml_ptr,
    o_ptr,
    stride_ob,
    stride_ot,
    stride_oh,
    head_dim,
    ml_size,
    SQ: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the splits of one (sequence, token, head) into the output row."""
    row = tl.program_id(0)  # (seq, tok) flattened
    head = tl.program_id(1)
    seq = row // SQ
    tok = row % SQ
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < head_dim
    base = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    m_s = tl.load(ml_ptr + base + offs_s, mask=s_ok, other=-1.0e30)
    l_s = tl.load(ml_ptr + ml_size + base + offs_s, mask=s_ok, other=0.0)
    acc_s = tl.load(
        acc_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_all = tl.max(m_s, 0)
    w = tl.math.exp2(m_s - m_all)
    l_all = tl.sum(w * l_s, 0)
    l_all = tl.where(l_all == 0.0, 1.0, l_all)
    o = tl.sum(w[:, None] * acc_s, 0) / l_all
    tl.store(
        o_ptr + seq.to(tl.int64) * stride_ob + tok * stride_ot + head * stride_oh + offs_d,
        o.to(o_ptr.dtype.element_ty),
        mask=d_ok,
    )


def _tiles(group: int, tokens: int) -> tuple[int, int, int]:
    """``(GROUP_PAD, BLOCK_M, BLOCK_R)``: rows are ``BLOCK_M`` tokens times ``GROUP_PAD`` heads,
    with ``BLOCK_M`` at most the next power of two of ``tokens`` and ``BLOCK_R`` (a power of two,
    at least ``MIN_ROWS``) holding them."""
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, min(MAX_ROWS // group_pad, triton.next_power_of_2(max(tokens, 1))))
    block_r = max(MIN_ROWS, block_m * group_pad)
    return group_pad, block_m, block_r


def num_splits_for(batch: int, num_kv_heads: int, max_blocks: int, block_size: int) -> int:
    """The decode kernel's split count, from shapes only (so a captured CUDA graph stays valid):
    enough programs to fill the GPU, each split covering at least ``SPLIT_MIN_KEYS`` keys of the
    longest context the block table can hold, at most ``MAX_SPLITS``."""
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max_blocks * block_size, SPLIT_MIN_KEYS)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim}: at most 256 is supported")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [Tq, H, D]`` (sequence ``i``'s queries are rows ``cu_seqlens_q[i] ..
    cu_seqlens_q[i+1]``) over each sequence's keys. With ``block_table [B, max_blocks]`` (int32)
    ``k``/``v`` are paged caches ``[num_blocks, block_size, Hkv, D]`` and sequence ``i`` has
    ``seqused_k[i]`` keys, else ``cu_seqlens_k[i+1] - cu_seqlens_k[i]``; without it ``k``/``v``
    are ``[Tk, Hkv, D]`` split by ``cu_seqlens_k``. ``causal``: aligned to the bottom right.
    ``max_seqlen_k`` is accepted for the interface and not needed. Returns ``out`` (or a new
    tensor) ``[Tq, H, D]`` in q's dtype."""
    del max_seqlen_k
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_tokens, num_heads, head_dim = q.shape
    paged = block_table is not None
    num_kv_heads = k.shape[2] if paged else k.shape[1]
    _check_heads(num_heads, num_kv_heads, head_dim)
    if not paged and cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is needed without a block_table")
    if paged and cu_seqlens_k is None and seqused_k is None:
        raise ValueError("a block_table needs cu_seqlens_k or seqused_k")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs == 0 or max_seqlen_q == 0 or num_tokens == 0:
        return out
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = num_heads // num_kv_heads
    group_pad, block_m, block_r = _tiles(group, max_seqlen_q)
    if paged:
        page = k.shape[1]
        kb, ks, kh = k.stride(0), k.stride(1), k.stride(2)
        vb, vs, vh = v.stride(0), v.stride(1), v.stride(2)
        table, stride_tb = block_table, block_table.stride(0)
    else:
        page = 1
        kb, ks, kh = 0, k.stride(0), k.stride(1)
        vb, vs, vh = 0, v.stride(0), v.stride(1)
        table, stride_tb = cu_seqlens_q, 0  # unread
    cu_k = cu_seqlens_k if cu_seqlens_k is not None else seqused_k
    used_k = seqused_k if seqused_k is not None else cu_k
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_kv_heads)
    _varlen_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_k,
        used_k,
        table,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kb,
        ks,
        kh,
        vb,
        vs,
        vh,
        stride_tb,
        scale * LOG2E,
        head_dim,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
        PAGE=page,
        PAGED=paged,
        CAUSAL=causal,
        HAS_USED_K=seqused_k is not None,
        num_warps=4,
        num_stages=2,
    )
    return out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    out: torch.Tensor | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """Attention of ``q [B, Sq, H, D]`` (``Sq = 1``: decode) over the paged caches ``[num_blocks,
    block_size, Hkv, D]``; sequence ``b`` has ``cache_seqlens[b]`` keys (int32), its new tokens
    included (already written), in pages ``block_table[b]`` (int32 ``[B, max_blocks]``).
    ``num_splits``: split-K count, 0 picks one from the shapes (:func:`num_splits_for`).

    CUDA-graph safe: no host sync and no value read from a tensor; scratch is allocated on q's
    device. Returns ``out`` (or a new tensor) ``[B, Sq, H, D]`` in q's dtype."""
    q = _last_dim_contiguous(q)
    k_cache, v_cache = _last_dim_contiguous(k_cache), _last_dim_contiguous(v_cache)
    batch, sq, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    _check_heads(num_heads, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or sq == 0:
        return out
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = num_heads // num_kv_heads
    group_pad, block_m, block_r = _tiles(group, sq)
    m_tiles = triton.cdiv(sq, block_m)
    splits = num_splits or num_splits_for(batch, num_kv_heads, block_table.shape[1], page)
    block_d = max(16, triton.next_power_of_2(head_dim))
    acc = torch.empty((batch, sq, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((2, batch, sq, num_heads, splits), dtype=torch.float32, device=q.device)
    _split_kernel[(batch * m_tiles, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        acc,
        ml,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        scale * LOG2E,
        head_dim,
        ml[0].numel(),
        SQ=sq,
        NUM_HEADS=num_heads,
        M_TILES=m_tiles,
        NUM_SPLITS=splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        PAGE=page,
        CAUSAL=causal,
        num_warps=4,
        num_stages=2,
    )
    _merge_kernel[(batch * sq, num_heads)](
        acc,
        ml,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        head_dim,
        ml[0].numel(),
        SQ=sq,
        NUM_HEADS=num_heads,
        NUM_SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
