"""Attention kernels on CPU, one layer at a time: where the native kernel, SDPA and the
shared-prefix split each win (the thresholds in ``engine.attention.cpu_backend``).

    python -m benchmarks.attention                  # SmolLM2's heads, bf16, 2 threads
    python -m benchmarks.attention --dtype float32 --threads 1

Prints milliseconds per layer for:
- prefill chunks of fresh tokens, native kernel vs one SDPA call per sequence vs one SDPA call
  for all of them (the backend's batch of whole prompts);
- prefill chunks after cached context (a shared prefix hit, then the prompt's own tokens), native
  kernel vs the backend's SDPA path (a gather of the context, a bottom-right causal mask);
- decodes behind a prefix shared by all (64 x 512, 64 x 2,048 and 16 x 2,048 tokens), native
  kernel alone vs the split (one SDPA call over the prefix + the kernel over each sequence's own
  keys + the merge);
- 64 decodes over distinct blocks (memory-bound: the K/V read rate is printed too).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan, sdpa_batches
from engine.kernels import native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def timed(fn: Callable[[], object], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def _cache(num_blocks: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def _prefill_case(
    qlen: int, seqs: int, dtype: torch.dtype, repeat: int
) -> tuple[float, float, float]:
    total = qlen * seqs
    blocks_per_seq = -(-qlen // BLOCK)
    k_cache, v_cache = _cache(seqs * blocks_per_seq, dtype)
    tables = torch.arange(seqs * blocks_per_seq).view(seqs, blocks_per_seq)
    q = torch.randn(total, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(total, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(total, KV_HEADS, HEAD_DIM).to(dtype)
    lens = torch.full((seqs,), qlen, dtype=torch.int64)
    starts = torch.arange(seqs, dtype=torch.int64) * qlen
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def per_seq_sdpa() -> None:
        for s in range(seqs):
            rows = slice(s * qlen, (s + 1) * qlen)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = o[0].transpose(0, 1)

    def kernel() -> None:
        native.paged_attention(q, k_cache, v_cache, tables, lens, starts, lens, out, scale)

    qsl = [s * qlen for s in range(seqs + 1)]
    batches, _ = sdpa_batches(list(range(seqs)), qsl, [qlen] * seqs, [qlen] * seqs)

    def batched_sdpa() -> None:
        for batch in batches:  # none for one sequence: the backend calls SDPA once anyway
            CpuAttentionBackend.prefill_batch(q, k, v, scale, out, batch)

    sdpa = timed(per_seq_sdpa, repeat)
    return timed(kernel, repeat), sdpa, timed(batched_sdpa, repeat) if batches else sdpa


def prefill(dtype: torch.dtype, repeat: int) -> None:
    print("prefill chunks of fresh tokens (ms per layer):")
    for qlen, seqs in ((32, 60), (96, 21), (100, 20), (100, 12), (544, 3), (512, 4), (2048, 1)):
        ours, sdpa, batched = _prefill_case(qlen, seqs, dtype, repeat)
        pairs = qlen * (qlen + 1) // 2
        print(
            f"  {seqs:3d} x {qlen:4d} tokens ({pairs:7d} pairs each): "
            f"native {ours:7.2f}  SDPA per sequence {sdpa:7.2f}  batched {batched:7.2f}"
        )


def _cached_case(
    qlen: int, ctx: int, seqs: int, dtype: torch.dtype, repeat: int
) -> tuple[float, float]:
    blocks_per_seq = -(-ctx // BLOCK)
    k_cache, v_cache = _cache(seqs * blocks_per_seq, dtype)
    tables = torch.randperm(seqs * blocks_per_seq).view(seqs, blocks_per_seq)
    q = torch.randn(seqs * qlen, HEADS, HEAD_DIM).to(dtype)
    lens = torch.full((seqs,), ctx, dtype=torch.int64)
    qlens = torch.full((seqs,), qlen, dtype=torch.int64)
    starts = torch.arange(seqs, dtype=torch.int64) * qlen
    qsl = [s * qlen for s in range(seqs + 1)]
    meta = AttentionMetadata(
        num_tokens=seqs * qlen,
        num_decodes=0,
        block_size=BLOCK,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl),
        seq_lens=lens,
        block_tables=tables,
        max_query_len=qlen,
        max_seq_len=ctx,
        query_start_loc_list=qsl,
        seq_lens_list=lens.tolist(),
    )
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def per_seq_sdpa() -> None:
        for s in range(seqs):
            CpuAttentionBackend.prefill_one(q, q, q, k_cache, v_cache, meta, scale, out, s)

    def kernel() -> None:
        native.paged_attention(q, k_cache, v_cache, tables, lens, starts, qlens, out, scale)

    return timed(kernel, repeat), timed(per_seq_sdpa, repeat)


def cached_prefill(dtype: torch.dtype, repeat: int) -> None:
    print("prefill chunks after cached context (ms per layer):")
    for qlen, ctx, seqs in ((32, 544, 8), (128, 1024, 4), (512, 2048, 1)):
        ours, sdpa = _cached_case(qlen, ctx, seqs, dtype, repeat)
        print(
            f"  {seqs:3d} x {qlen:4d} tokens after {ctx - qlen:4d} cached: "
            f"native {ours:7.2f}  SDPA {sdpa:7.2f}"
        )


def decode(dtype: torch.dtype, repeat: int) -> None:
    for seqs, prefix in ((64, 512), (64, 2048), (16, 2048)):
        shared_decode(seqs, prefix, 64, dtype, repeat)
    distinct_decode(64, 512, 64, dtype, repeat)


def shared_decode(seqs: int, prefix: int, own: int, dtype: torch.dtype, repeat: int) -> None:
    scale = HEAD_DIM**-0.5
    per_seq = (prefix + own) // BLOCK
    k_cache, v_cache = _cache(prefix // BLOCK + seqs * own // BLOCK + 8, dtype)
    shared = torch.arange(prefix // BLOCK)
    tables = torch.empty(seqs, per_seq, dtype=torch.int64)
    for s in range(seqs):
        start = prefix // BLOCK + s * (own // BLOCK)
        tables[s] = torch.cat([shared, torch.arange(start, start + own // BLOCK)])
    lens = torch.full((seqs,), prefix + own, dtype=torch.int64)
    starts = torch.arange(seqs, dtype=torch.int64)
    ones = torch.ones(seqs, dtype=torch.int64)
    q = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    # The backend's own path: prepare() finds the shared blocks (consecutive here, as when one
    # request allocated them) and forward() splits; the K/V of this step are already cached.
    qsl = list(range(seqs + 1))
    meta = AttentionMetadata(
        num_tokens=seqs,
        num_decodes=seqs,
        block_size=BLOCK,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl),
        seq_lens=lens,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=prefix + own,
        query_start_loc_list=qsl,
        seq_lens_list=lens.tolist(),
    )
    backend = CpuAttentionBackend()
    backend.prepare(meta)
    assert meta.plan_as(CpuAttentionPlan).shared_prefix_tokens == prefix
    backend.write_kv = lambda *args: None  # type: ignore[method-assign]
    no_kv = torch.empty(0, KV_HEADS, HEAD_DIM, dtype=dtype)

    def split() -> None:
        backend.forward(q, no_kv, no_kv, k_cache, v_cache, meta, scale)

    kernel = timed(
        lambda: native.paged_attention(q, k_cache, v_cache, tables, lens, starts, ones, out, scale),
        repeat,
    )
    print(
        f"{seqs} decodes, {prefix} shared + {own} own tokens (ms per layer): native "
        f"{kernel:.2f}  split {timed(split, repeat):.2f}"
    )


def distinct_decode(seqs: int, prefix: int, own: int, dtype: torch.dtype, repeat: int) -> None:
    scale = HEAD_DIM**-0.5
    per_seq = (prefix + own) // BLOCK
    lens = torch.full((seqs,), prefix + own, dtype=torch.int64)
    starts = torch.arange(seqs, dtype=torch.int64)
    ones = torch.ones(seqs, dtype=torch.int64)
    q = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    distinct = torch.randperm(seqs * per_seq * 4)[: seqs * per_seq].view(seqs, per_seq)
    k_cache, v_cache = _cache(seqs * per_seq * 4, dtype)
    ms = timed(
        lambda: native.paged_attention(
            q, k_cache, v_cache, distinct, lens, starts, ones, out, scale
        ),
        repeat,
    )
    read = 2 * seqs * (prefix + own) * KV_HEADS * HEAD_DIM * q.element_size()
    print(
        f"{seqs} decodes, {prefix + own} distinct tokens each: native {ms:.2f} ms per layer, "
        f"K/V read at {read / ms / 1e6:.1f} GB/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native kernel could not be built (no C compiler?)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {args.threads} threads, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}")
    print(f"bf16 prefill chunks all take the native kernel: {native.bf16_prefill_preferred()}")
    prefill(dtype, args.repeat)
    cached_prefill(dtype, args.repeat)
    decode(dtype, args.repeat)


if __name__ == "__main__":
    main()
