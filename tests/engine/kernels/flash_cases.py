"""The Triton FlashAttention kernels against plain PyTorch attention, as named checks that run on
any device: in-process on CUDA, and in a child process under Triton's CPU interpreter (run as
``TRITON_INTERPRET=1 python -m tests.engine.kernels.flash_cases``, which prints one JSON object:
each check's failure text per dtype, or null). The interpreter must be chosen before triton is
first imported, hence the separate process.

Each check builds paged caches with shuffled pages (garbage in every slot no sequence owns), so a
kernel that reads the wrong page or a slot past a sequence's end gives a wrong answer.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Paged:
    """Paged caches holding ``seqs`` (each ``(context length, query length)``) and the queries of
    their last ``query length`` positions; ``keys[i]``/``values[i]`` are sequence ``i``'s full
    context ``[ctx, Hkv, D]``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_q: torch.Tensor
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def build(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
) -> Paged:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(need) + 3
    pages = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen) * 4  # garbage, overwritten where owned
    v_cache = torch.randn(shape, generator=gen) * 4
    width = max(need)
    table = torch.zeros(len(seqs), width + 2, dtype=torch.int32)  # padded columns read as page 0
    queries, keys, values = [], [], []
    for i, ((ctx, qlen), n) in enumerate(zip(seqs, need, strict=True)):
        own = [pages.pop() for _ in range(n)]
        table[i, :n] = torch.tensor(own, dtype=torch.int32)
        k = torch.randn(ctx, kv_heads, dim, generator=gen)
        v = torch.randn(ctx, kv_heads, dim, generator=gen)
        for pos in range(ctx):
            k_cache[own[pos // block_size], pos % block_size] = k[pos]
            v_cache[own[pos // block_size], pos % block_size] = v[pos]
        queries.append(torch.randn(qlen, heads, dim, generator=gen))
        keys.append(k)
        values.append(v)
    cu_q = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return Paged(
        q=dev(torch.cat(queries)),
        k_cache=dev(k_cache),
        v_cache=dev(v_cache),
        block_table=table.to(device),
        seq_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device),
        cu_q=cu_q.to(device=device, dtype=torch.int32),
        queries=[dev(t) for t in queries],
        keys=[dev(t) for t in keys],
        values=[dev(t) for t in values],
    )


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """SDPA in float32 of ``q [qlen, H, D]`` over ``k``/``v [ctx, Hkv, D]``, the causal mask
    aligned to the bottom right."""
    qlen, ctx = q.shape[0], k.shape[0]
    qq, kk, vv = (t.float().transpose(0, 1) for t in (q, k, v))
    mask = None
    if causal:
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - qlen, ctx)[:, None]
        mask = mask.to(q.device)
    o = torch.nn.functional.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(0, 1)


def close(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = TOLERANCE[out.dtype]
    if not torch.isfinite(out).all():
        raise AssertionError(f"{what}: non-finite output")
    err = (out.float() - expected.float()).abs().max().item()
    if err > tol:
        raise AssertionError(f"{what}: max abs error {err:.3g} > {tol:g}")


# (context length, query length): a decode, a chunk after a cached prefix that starts mid-page,
# a whole prefill longer than a key tile, a chunk ending on a page boundary, a one-token context.
MIXED = [(9, 1), (37, 10), (70, 70), (32, 5), (1, 1)]


def varlen_paged(device: str, dtype: torch.dtype) -> None:
    from engine.kernels.triton_flash import flash_attn_varlen_func

    for heads, kv_heads, dim, block_size in [(4, 2, 32, 16), (2, 2, 16, 32), (8, 1, 64, 16)]:
        p = build(MIXED, heads, kv_heads, dim, block_size, device, dtype)
        scale = dim**-0.5
        cu_k = torch.zeros(len(MIXED) + 1, dtype=torch.int32, device=device)
        cu_k[1:] = p.seq_lens.cumsum(0)
        out = flash_attn_varlen_func(
            p.q,
            p.k_cache,
            p.v_cache,
            cu_seqlens_q=p.cu_q,
            max_seqlen_q=max(q for _, q in MIXED),
            cu_seqlens_k=cu_k,
            max_seqlen_k=max(c for c, _ in MIXED),
            softmax_scale=scale,
            causal=True,
            block_table=p.block_table,
        )
        used = flash_attn_varlen_func(
            p.q,
            p.k_cache,
            p.v_cache,
            p.cu_q,
            max(q for _, q in MIXED),
            None,
            0,
            softmax_scale=scale,
            causal=True,
            block_table=p.block_table,
            seqused_k=p.seq_lens,
            out=torch.empty_like(p.q),
        )
        torch.testing.assert_close(used, out, rtol=0, atol=0)
        for i, (s, e) in enumerate(zip(p.cu_q[:-1].tolist(), p.cu_q[1:].tolist(), strict=True)):
            expected = reference(p.queries[i], p.keys[i], p.values[i], scale)
            close(out[s:e], expected, f"H={heads} Hkv={kv_heads} D={dim} page={block_size} seq {i}")


def varlen_contiguous(device: str, dtype: torch.dtype) -> None:
    """No block table: K/V ``[Tk, Hkv, D]`` split by ``cu_seqlens_k``; causal and not."""
    from engine.kernels.triton_flash import flash_attn_varlen_func

    p = build(MIXED, 4, 2, 32, 16, device, dtype)
    k, v = torch.cat(p.keys), torch.cat(p.values)
    cu_k = torch.zeros(len(MIXED) + 1, dtype=torch.int32, device=device)
    cu_k[1:] = p.seq_lens.cumsum(0)
    for causal in (True, False):
        out = flash_attn_varlen_func(
            p.q, k, v, p.cu_q, max(q for _, q in MIXED), cu_k, 70, causal=causal
        )
        for i, (s, e) in enumerate(zip(p.cu_q[:-1].tolist(), p.cu_q[1:].tolist(), strict=True)):
            expected = reference(p.queries[i], p.keys[i], p.values[i], 32**-0.5, causal)
            close(out[s:e], expected, f"causal={causal} seq {i}")


def kvcache(device: str, dtype: torch.dtype) -> None:
    """Decodes (Sq = 1) and two-token steps, one split and several: contexts shorter than a
    page, across pages, and longer than one split (150 keys over 2 and 4 splits, 4 leaving a
    split empty)."""
    from engine.kernels.triton_flash import flash_attn_with_kvcache

    for sq in (1, 2):
        for heads, kv_heads, dim in [(4, 2, 32), (2, 2, 16)]:
            seqs = [(3, sq), (17, sq), (150, sq), (64, sq)]
            p = build(seqs, heads, kv_heads, dim, 16, device, dtype, seed=sq)
            q = p.q.view(len(seqs), sq, heads, dim)
            for splits in (0, 1, 2, 4):
                out = flash_attn_with_kvcache(
                    q, p.k_cache, p.v_cache, p.seq_lens, p.block_table, num_splits=splits
                )
                for i in range(len(seqs)):
                    expected = reference(p.queries[i], p.keys[i], p.values[i], dim**-0.5)
                    what = f"Sq={sq} H={heads} Hkv={kv_heads} splits={splits} seq {i}"
                    close(out[i], expected, what)
            # A padding row of a captured batch (no keys): zeros, and the others unchanged.
            lens = p.seq_lens.clone()
            lens[1] = 0
            padded = flash_attn_with_kvcache(
                q, p.k_cache, p.v_cache, lens, p.block_table, num_splits=4
            )
            full = flash_attn_with_kvcache(
                q, p.k_cache, p.v_cache, p.seq_lens, p.block_table, num_splits=4
            )
            if padded[1].abs().max().item() != 0 or not torch.equal(padded[2], full[2]):
                raise AssertionError(f"Sq={sq}: a sequence with no keys changed the output")


def backend(device: str, dtype: torch.dtype) -> None:
    """FlashAttentionBackend on the triton kernels against the torch backend, on the same
    metadata: a mixed step (varlen) and a pure-decode step (with_kvcache)."""
    from engine.attention.flash_backend import FlashAttentionBackend
    from engine.attention.flash_kernels import load_flash_kernels
    from engine.attention.torch_backend import TorchAttentionBackend
    from tests.engine.attention.test_torch_backend import DIM, mixed_batch

    flash = FlashAttentionBackend(load_flash_kernels("triton"))
    for seqs, decodes in [([(5, 1), (9, 1), (12, 4), (7, 7), (11, 6)], 2), ([(5, 1), (30, 1)], 2)]:
        step, _ = mixed_batch(seqs, decodes, torch.Generator().manual_seed(3))
        q, k, v, k_cache, v_cache, meta = step
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(device))
        q, k, v, k_cache, v_cache = (t.to(device, dtype) for t in (q, k, v, k_cache, v_cache))
        ref_caches = k_cache.clone(), v_cache.clone()
        ref = TorchAttentionBackend()
        ref.prepare(meta)
        expected = ref.forward(q, k, v, *ref_caches, meta, DIM**-0.5)
        flash.prepare(meta)
        out = flash.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
        close(out, expected, f"backend, {decodes} decodes of {len(seqs)}")
        torch.testing.assert_close(k_cache, ref_caches[0], rtol=0, atol=0)


CASES: dict[str, Callable[[str, torch.dtype], None]] = {
    "varlen_paged": varlen_paged,
    "varlen_contiguous": varlen_contiguous,
    "kvcache": kvcache,
    "backend": backend,
}
INTERPRETER_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def run_all(device: str, dtypes: dict[str, torch.dtype]) -> dict[str, str | None]:
    """Each case per dtype (``"case/dtype"``) -> None when it passed, else its traceback."""
    results: dict[str, str | None] = {}
    for name, check in CASES.items():
        for dname, dtype in dtypes.items():
            try:
                check(device, dtype)
                results[f"{name}/{dname}"] = None
            except Exception:
                results[f"{name}/{dname}"] = traceback.format_exc()
    return results


def patch_interpreter_scalars() -> None:
    """Triton 3.6's interpreter holds a scalar as a one-element array and turns it into a Python
    int with ``int(array)``, which NumPy >= 2.4 refuses for arrays of one dimension; a loop with
    a bound computed in the kernel (``range(lo, hi)``) needs that. Convert with ``.item()``
    instead, which works for any one-element array."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:  # noqa: ANN001 -- triton's private types
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        sys.exit("run with TRITON_INTERPRET=1, before anything imports triton")
    patch_interpreter_scalars()
    print(json.dumps(run_all("cpu", INTERPRETER_DTYPES)))
