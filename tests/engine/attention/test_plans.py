"""Each backend's per-step plan: what ``prepare`` derives from the batch layout, and that a
backend reads only a plan of its own kind."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan, sdpa_batches
from engine.attention.flash_backend import FlashAttentionPlan, flash_plan
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan
from engine.kernels import native
from tests.engine.attention.test_torch_backend import DIM, dense_attention, mixed_batch

needs_kernel = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

# Two decodes, a chunk after cached context, and a whole prefill of more (query, key) pairs
# (91 * 91 - 91 * 90 / 2 = 4186) than the native kernel takes in float32 and float16.
SEQS = [(5, 1), (9, 1), (12, 4), (91, 91)]


def _layout(block_size: int, seq_lens: list[int], qlens: list[int]) -> AttentionMetadata:
    qsl = [0, *accumulate(qlens)]
    width = max(-(-n // block_size) for n in seq_lens)
    tables = torch.arange(len(seq_lens) * width).view(len(seq_lens), width)
    return AttentionMetadata(
        num_tokens=qsl[-1],
        num_decodes=sum(q == 1 for q in qlens),
        block_size=block_size,
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        block_tables=tables,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        query_start_loc_list=qsl,
        seq_lens_list=seq_lens,
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_plan_splits_the_step_and_attends_like_dense_attention(dtype):
    gen = torch.Generator().manual_seed(2)
    step, (_, full_k, full_v, q_parts, qsl) = mixed_batch(SEQS, 2, gen)
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in step[:5])
    meta = step[5]
    backend = CpuAttentionBackend(dtype)
    backend.prepare(meta)
    plan = meta.plan_as(CpuAttentionPlan)
    # The long prefill goes to SDPA; the rest is one native call, in step order.
    assert plan.sdpa_seqs == [3] and plan.shared_prefix_tokens == 0
    assert plan.native_seqs is not None
    assert plan.native_seqs.query_start.tolist() == qsl[:3]
    assert plan.native_seqs.query_len.tolist() == [1, 1, 4]
    assert plan.native_seqs.seq_lens.tolist() == [5, 9, 12]
    assert backend.native_step(meta) is None  # part of the step is not native

    out = backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    # float16 has no native path: the reference plan is made for the step, once.
    assert (plan.reference is not None) == (dtype == torch.float16)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-3, "rtol": 5e-3}
    for i in range(len(SEQS)):
        # In float32 from the inputs as the backend saw them (rounded to ``dtype``).
        qi, ki, vi = (t.to(dtype).float() for t in (q_parts[i], full_k[i], full_v[i]))
        got = out[qsl[i] : qsl[i + 1]].float()
        torch.testing.assert_close(got, dense_attention(qi, ki, vi), **tol)


def test_torch_plan_masks_each_decode_to_its_context():
    meta = _layout(4, [5, 9, 12, 7], [1, 1, 4, 7])
    TorchAttentionBackend().prepare(meta)
    plan = meta.plan_as(TorchAttentionPlan)
    assert plan.decode_block_tables is not None and plan.decode_mask is not None
    # cdiv(9, 4) = 3 blocks cover the longest decode.
    torch.testing.assert_close(plan.decode_block_tables, meta.block_tables[:2, :3])
    assert plan.decode_mask.shape == (2, 1, 1, 12)
    assert plan.decode_mask.flatten(1).sum(1).tolist() == [5, 9]
    assert plan.decode_windows == {}

    prefills_only = _layout(4, [12, 7], [4, 7])
    TorchAttentionBackend().prepare(prefills_only)
    assert prefills_only.plan == TorchAttentionPlan()


def test_flash_plan_is_the_kernels_int32_view_of_the_step():
    seq_lens, qlens = [40, 17, 33], [1, 17, 8]
    meta = _layout(16, seq_lens, qlens)
    plan = flash_plan(meta)
    assert isinstance(plan, FlashAttentionPlan)
    assert plan.cu_seqlens_q.dtype == plan.cu_seqlens_k.dtype == torch.int32
    assert plan.block_table.dtype == torch.int32
    assert plan.cu_seqlens_q.tolist() == [0, 1, 18, 26]
    assert plan.cu_seqlens_k.tolist() == [0, 40, 57, 90]
    assert torch.equal(plan.block_table.long(), meta.block_tables)

    assert plan.cache_seqlens.dtype == torch.int32
    assert plan.cache_seqlens.tolist() == seq_lens

    with pytest.raises(ValueError, match="block_size"):
        flash_plan(_layout(8, seq_lens, qlens))
    # The Triton kernels take any block size.
    assert flash_plan(_layout(8, seq_lens, qlens), block_multiple=1).block_table.shape == (3, 5)


def test_flash_plan_of_a_pure_decode_step_is_the_kvcache_call_alone():
    meta = _layout(16, [40, 17, 1], [1, 1, 1])
    # The decision reads num_decodes and shapes, never the host lists.
    meta.seq_lens_list = meta.query_start_loc_list = None  # type: ignore[assignment]
    plan = flash_plan(meta)
    assert plan.cu_seqlens_q is None and plan.cu_seqlens_k is None
    assert plan.cache_seqlens.tolist() == [40, 17, 1]
    assert plan.cache_seqlens.dtype == plan.block_table.dtype == torch.int32


def test_a_backend_reads_only_a_plan_of_its_own_kind():
    meta = _layout(4, [5, 12], [1, 4])
    with pytest.raises(TypeError, match="NoneType"):
        meta.plan_as(TorchAttentionPlan)
    TorchAttentionBackend().prepare(meta)
    with pytest.raises(TypeError, match="TorchAttentionPlan, not a CpuAttentionPlan"):
        meta.plan_as(CpuAttentionPlan)


def test_sdpa_batches_group_whole_prompts_of_similar_length():
    # Sequences 0-2: whole prompts 100, 100, 110 (within the spread); 3: a chunk after cached
    # context; 4: a whole prompt too long to join; 5: alone in its length class too.
    qlens = [100, 100, 110, 20, 300, 40]
    lens = [100, 100, 110, 60, 300, 40]
    qsl = [0, *accumulate(qlens)]
    batches, alone = sdpa_batches(list(range(6)), qsl, qlens, lens)
    assert alone == [3, 4, 5]
    (batch,) = batches
    assert batch.seqs == [0, 1, 2] and batch.max_len == 110 and batch.span is None
    assert batch.rows is not None and batch.real is not None and batch.tokens is not None
    rows = batch.rows.view(3, 110)
    # Each sequence's rows, padded with its last row; the real entries are exactly its tokens.
    assert rows[0, :100].tolist() == list(range(100)) and set(rows[0, 100:].tolist()) == {99}
    assert rows[2].tolist() == list(range(200, 310))
    assert batch.tokens.tolist() == list(range(310))

    # Consecutive prompts of one length are viewed in place.
    batches, alone = sdpa_batches([0, 1], [0, 100, 200], [100, 100], [100, 100])
    assert alone == [] and batches[0].span == (0, 200) and batches[0].rows is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqs",
    [
        [(5, 1), (16, 16), (16, 16), (16, 16)],  # one length, consecutive: viewed in place
        [(12, 12), (3, 1), (14, 14), (10, 4), (13, 13)],  # padded, between other kinds
    ],
)
def test_batched_whole_prompts_attend_like_dense_attention(dtype, seqs):
    gen = torch.Generator().manual_seed(3)
    step, (_, full_k, full_v, q_parts, qsl) = mixed_batch(seqs, 0, gen)
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in step[:5])
    meta = step[5]
    backend = CpuAttentionBackend(dtype)
    backend.native_max_pairs = 60  # whole prompts of 11+ tokens go to SDPA, the rest native
    backend.prepare(meta)
    plan = meta.plan_as(CpuAttentionPlan)
    whole = [i for i, (ctx, qlen) in enumerate(seqs) if ctx == qlen]
    assert [i for b in plan.sdpa_batches for i in b.seqs] == whole
    assert plan.sdpa_seqs == []
    out = backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for i in range(len(seqs)):
        qi, ki, vi = (t.to(dtype).float() for t in (q_parts[i], full_k[i], full_v[i]))
        got = out[qsl[i] : qsl[i + 1]].float()
        torch.testing.assert_close(got, dense_attention(qi, ki, vi), **tol)


def _shared_decodes(seqs: int, prefix_blocks: int, block_size: int = 16) -> AttentionMetadata:
    """``seqs`` decodes whose block tables all start with the same ``prefix_blocks`` blocks,
    then one block of their own."""
    meta = _layout(block_size, [(prefix_blocks + 1) * block_size] * seqs, [1] * seqs)
    meta.block_tables[:, :prefix_blocks] = torch.arange(prefix_blocks)
    return meta


@needs_kernel
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("f32_stack", [False, True])
def test_shared_prefix_split_threshold_where_decodes_stay_one_native_call(
    one_pass, f32_stack, monkeypatch
):
    """Where bf16 decodes take the one-pass AVX512-BF16 kernel, a step of 64 decodes behind a
    512-token prefix stays one native call (cheaper than the split there); behind 2,048 tokens
    it still splits. Likewise in float32 where the float32 kernel (and with it the one-call
    stack) runs. Elsewhere both split."""
    monkeypatch.setattr(native, "bf16_decode_one_pass", lambda: one_pass)
    monkeypatch.setattr(native, "f32_linear_preferred", lambda: f32_stack)
    bf16, f32 = CpuAttentionBackend(torch.bfloat16), CpuAttentionBackend(torch.float32)
    for prefix_tokens, split_in_bf16, split_in_f32 in (
        (512, not one_pass, not f32_stack),
        (2048, True, True),
    ):
        for backend, splits in ((bf16, split_in_bf16), (f32, split_in_f32)):
            meta = _shared_decodes(64, prefix_tokens // 16)
            backend.prepare(meta)
            expected = prefix_tokens if splits else 0
            assert meta.plan_as(CpuAttentionPlan).shared_prefix_tokens == expected
            assert (backend.native_step(meta) is not None) == (not splits)


def _burst(
    prefix_blocks: int, followers: int, suffix: int, decodes: int = 0, cached: bool = False
) -> AttentionMetadata:
    """``decodes`` decodes, then a leader and ``followers`` chunks of ``suffix`` tokens behind one
    ``prefix_blocks``-block prefix (block size 16), which the leader computes in this step
    (the step of a burst behind a new system prompt) unless ``cached``. The decodes sit behind
    the same prefix."""
    prefix = prefix_blocks * 16
    lens = [prefix + 1] * decodes + [prefix + suffix] * (1 + followers)
    qlens = [1] * decodes + [suffix + (0 if cached else prefix)] + [suffix] * followers
    meta = _layout(16, lens, qlens)
    meta.block_tables[:, :prefix_blocks] = meta.block_tables[decodes, :prefix_blocks].clone()
    return meta


@needs_kernel
def test_a_burst_behind_a_new_prefix_splits_its_followers_run(monkeypatch):
    """Float32: the followers' chunks (each past the native kernel's pairs) attend the leader's
    prefix in one split; the leader, whose queries are the prefix, attends unsplit."""
    monkeypatch.setattr(native, "f32_linear_preferred", lambda: True)
    backend = CpuAttentionBackend(torch.float32)
    meta = _burst(prefix_blocks=32, followers=47, suffix=32)
    backend.prepare(meta)
    plan = meta.plan_as(CpuAttentionPlan)
    assert plan.shared is not None
    assert plan.shared.seqs == (1, 48) and plan.shared.tokens == 512
    assert plan.shared.rows == (544, meta.num_tokens)
    assert plan.shared.own.query_len.tolist() == [32] * 47
    assert plan.sdpa_seqs == [0] and plan.native_seqs is None
    assert backend.native_step(meta) is None


@needs_kernel
@pytest.mark.parametrize("prefix_blocks, splits", [(32, False), (128, True)])
def test_without_split_chunks_only_decodes_join_the_split(prefix_blocks, splits, monkeypatch):
    """bf16 where the kernel's tiles take every chunk: 48 decodes and a burst behind one prefix
    split the decodes' run only (when it pays: 48 x 2,048 prefix tokens, not 48 x 512); the
    chunks stay in the native call."""
    monkeypatch.setattr(native, "bf16_prefill_preferred", lambda: True)
    monkeypatch.setattr(native, "bf16_decode_one_pass", lambda: True)
    backend = CpuAttentionBackend(torch.bfloat16)
    assert not backend.split_chunks
    meta = _burst(prefix_blocks, followers=15, suffix=32, decodes=48, cached=True)
    backend.prepare(meta)
    plan = meta.plan_as(CpuAttentionPlan)
    if splits:
        assert plan.shared is not None and plan.shared.seqs == (0, 48)
        assert plan.native_seqs is not None and plan.native_seqs.query_len.tolist() == [32] * 16
    else:
        assert plan.shared is None
        assert plan.native_seqs is not None and len(plan.native_seqs.query_len) == 64
    assert plan.sdpa_seqs == [] and plan.sdpa_batches == []
