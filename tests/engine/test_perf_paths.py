"""Fast paths against their reference paths: the native paged attention kernel vs a plain softmax
over each sequence's tokens, the shared-prefix split, the ``cpu`` attention backend vs the pure-PyTorch one, and the
fallbacks when the kernel cannot be built."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import select_backend
from engine.cpuinfo import cpu_flags
from engine.kernels import native
from tests.helpers import decodes_and_a_chunk

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="the native kernel needs a C compiler",
)


def reference_attention(q, k_cache, v_cache, tables, lens, qlens, scale, kv_start=0):
    """Causal attention of each sequence's query tokens (the last ``qlens[s]`` positions of its
    ``lens[s]``) over its cached keys from ``kv_start``, with each row's log-sum-exp."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    outs, lses = [], []
    start = 0
    for s, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
        blocks = tables[s, : -(-n // block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        qs = q[start : start + ql].float().view(ql, num_kv_heads, group, head_dim)
        scores = torch.einsum("thgd,khd->thgk", qs, k) * scale
        pos = torch.arange(n - ql, n)[:, None]
        keys = torch.arange(n)[None, :]
        seen = (keys <= pos) & (keys >= kv_start)
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        p = torch.nan_to_num(torch.exp(scores - lse[..., None]))
        outs.append(torch.einsum("thgk,khd->thgd", p, v).reshape(ql, num_heads, head_dim))
        lses.append(lse.reshape(ql, num_heads))
        start += ql
    return torch.cat(outs), torch.cat(lses)


def _random_batch(dtype, heads, kv_heads, head_dim, block_size, lens, qlens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 * sum(-(-n // block_size) for n in lens)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    q = torch.randn(sum(qlens), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables.view(len(lens), max_blocks)


def _starts(qlens):
    return torch.tensor([sum(qlens[:i]) for i in range(len(qlens))], dtype=torch.int64)


def _assert_kernel_matches_reference(
    q, k_cache, v_cache, tables, lens, qlens, kv_start, tol, lse_tol
):
    """The native kernel's output and log-sum-exp for the batch against float32 attention."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    scale = q.shape[2] ** -0.5
    args = (tables, torch.tensor(lens), _starts(qlens), torch.tensor(qlens))
    native.paged_attention(q, k_cache, v_cache, *args, out, scale, kv_start=kv_start, lse=lse)
    expected, expected_lse = reference_attention(
        q, k_cache, v_cache, tables, lens, qlens, scale, kv_start
    )
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, expected_lse, atol=lse_tol, rtol=lse_tol)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 64, 8), (8, 1, 64, 16), (4, 2, 16, 4), (6, 3, 32, 16), (4, 2, 128, 32)],
    ids=["smollm2", "mha", "group8", "small-dim", "dim32", "dim128"],
)
@pytest.mark.parametrize("kv_start_blocks", [0, 1])
def test_native_attention_matches_reference(
    dtype, heads, kv_heads, head_dim, block_size, kv_start_blocks
):
    """Decodes and prefill chunks in one call: lengths of 1, exactly a block, one past a block,
    chunks after cached context, a whole prompt; with and without a skipped leading block."""
    assert native.available()
    bs = block_size
    lens = [1, bs, bs + 1, 37, 70, 5, 2 * bs - 1, 100]
    qlens = [1, bs, 1, 20, 70, 3, 1, 1]
    q, k_cache, v_cache, tables = _random_batch(dtype, heads, kv_heads, head_dim, bs, lens, qlens)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    kv_start = kv_start_blocks * bs
    native.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(lens),
        _starts(qlens),
        torch.tensor(qlens),
        out,
        head_dim**-0.5,
        kv_start=kv_start,
        lse=lse,
    )
    expected, expected_lse = reference_attention(
        q, k_cache, v_cache, tables, lens, qlens, head_dim**-0.5, kv_start
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # Rows that see no key (the length-1 sequence past a skipped block): out 0, lse -inf.
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-4)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 2, 64, 32), (8, 1, 64, 16), (14, 2, 64, 16), (4, 2, 128, 16)],
    ids=["smollm2", "group4-block32", "group8", "group7", "dim128"],
)
@pytest.mark.parametrize("kv_start_blocks", [0, 1])
def test_native_attention_of_a_decode_batch_matches_reference(
    dtype, heads, kv_heads, head_dim, block_size, kv_start_blocks
):
    """A batch of decodes large enough that each sequence is one work item over all its KV
    heads (a decode step's path; with bf16 on AMX or on AVX512-BF16, every head's scores from
    whole cache rows in one pass over the keys, and on AVX512-BF16 the values too, with the
    groups of more than four query heads in parts): contexts shorter than a chunk of 16 keys, exactly one, one past,
    across blocks, and long ones whose highest scores come late; a sequence whose keys all lie
    before kv_start gets zeros and a log-sum-exp of -inf."""
    bs = block_size
    gen = random.Random(5)
    lens = [1, 15, 16, 17, bs, bs + 1, 2 * bs + 3, 300] + [gen.randint(1, 260) for _ in range(56)]
    qlens = [1] * len(lens)
    q, k_cache, v_cache, tables = _random_batch(
        dtype, heads, kv_heads, head_dim, bs, lens, qlens, seed=11
    )
    # Late keys that score far above all the earlier ones.
    k_cache[tables[7, -(-300 // bs) - 1]] *= 6
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _assert_kernel_matches_reference(
        q, k_cache, v_cache, tables, lens, qlens, kv_start_blocks * bs, tol, 1e-4
    )


@needs_compiler
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 1, 64, 32), (4, 4, 128, 16), (16, 16, 32, 48)],
    ids=["smollm2", "group8-block32", "mha-dim128", "group1-block48"],
)
@pytest.mark.parametrize("kv_start_blocks", [0, 2])
def test_native_attention_long_bf16_chunks_match_reference(
    heads, kv_heads, head_dim, block_size, kv_start_blocks
):
    """Prefill chunks the size SDPA used to take (a whole 300-token prompt, 45 tokens after 472
    cached, 17 after 17): on a CPU with AMX the kernel's AMX tiles (keys in passes of 256, so
    the 300-token prompt and the chunk after 472 cross passes; groups of 8 heads score in two
    rounds of tiles), else with AVX512-BF16 its bf16 tile (both round probabilities to bf16 for
    the value sums), elsewhere the generic loop; each within bf16's tolerance of float32
    attention, log-sum-exp included."""
    bs = block_size
    lens, qlens = [300, 517, 34, 1], [300, 45, 17, 1]
    q, k_cache, v_cache, tables = _random_batch(
        torch.bfloat16, heads, kv_heads, head_dim, bs, lens, qlens, seed=3
    )
    _assert_kernel_matches_reference(
        q, k_cache, v_cache, tables, lens, qlens, kv_start_blocks * bs, 2e-2, 1e-3
    )


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("kv_start_blocks", [0, 3])
def test_native_attention_of_one_long_prompt_matches_reference(threads, kv_start_blocks):
    """One 700-token prompt beside a 40-token chunk after 660 cached, a 40-token prompt and a
    decode, SmolLM2's shapes: on AMX the long prompt is cut into runs of tiles (each packing the
    keys it reads once) so that the threads share it, and every cut must give the same rows;
    rows before kv_start see no key (at 3 blocks, the whole 40-token prompt)."""
    lens, qlens = [700, 700, 40, 90], [700, 40, 40, 1]
    q, k_cache, v_cache, tables = _random_batch(torch.bfloat16, 9, 3, 64, 16, lens, qlens, seed=7)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_kernel_matches_reference(
            q, k_cache, v_cache, tables, lens, qlens, kv_start_blocks * 16, 2e-2, 1e-3
        )
    finally:
        torch.set_num_threads(before)


@needs_compiler
def test_native_attention_on_a_subset_writes_only_its_rows():
    """A subset of a batch's sequences (with their own query offsets) leaves other rows alone."""
    lens, qlens = [6, 9, 30], [1, 4, 2]
    q, k_cache, v_cache, tables = _random_batch(torch.float32, 4, 2, 64, 4, lens, qlens, seed=1)
    out = torch.zeros_like(q)
    pick = torch.tensor([0, 2])
    native.paged_attention(
        q,
        k_cache,
        v_cache,
        tables[pick].contiguous(),
        torch.tensor(lens)[pick],
        _starts(qlens)[pick].contiguous(),
        torch.tensor(qlens)[pick],
        out,
        0.125,
    )
    expected, _ = reference_attention(q, k_cache, v_cache, tables, lens, qlens, 0.125)
    rows = [0, 5, 6]
    torch.testing.assert_close(out[rows], expected[rows], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[1:5]) == 0


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_write_matches_index_copy(dtype):
    """K/V rows taken as views of a fused qkv output (row stride > one row) land in their slots,
    and nothing else in the cache changes."""
    gen = torch.Generator().manual_seed(4)
    kv_heads, head_dim, tokens = 2, 16, 5
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    k = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([7, 0, 12, 3, 8])
    caches = [torch.randn(4, 4, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    for cache, rows in zip(expected, (k, v), strict=True):
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, rows)
    assert native.write_kv_cache(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    # A layout it does not take (heads not adjacent) is left to the caller.
    assert not native.write_kv_cache(k.transpose(0, 1), v, caches[0], caches[1], slots)


# (context lengths, query lengths, the sequences behind the shared prefix, the run split).
SPLIT_LAYOUTS = {
    # Every sequence behind the prefix: the whole step splits.
    "whole": ([40, 33, 57, 35], [1, 1, 9, 3], [0, 1, 2, 3], (0, 4)),
    # A fresh prompt between two runs behind the prefix: the run of more rows splits, the rest
    # attends unsplit.
    "run": ([40, 33, 20, 57, 35], [1, 1, 20, 9, 3], [0, 1, 3, 4], (3, 5)),
}


@needs_compiler
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_split_matches_reference(dtype, layout, monkeypatch):
    """Sequences behind the same 4 cached blocks: the backend attends the prefix once (SDPA) for
    their run and merges it with the kernel's pass over each sequence's own keys."""
    from engine.attention import cpu_backend
    from engine.attention.base import AttentionMetadata

    monkeypatch.setattr(cpu_backend, "CASCADE_MIN_PAIRS", 1)
    bs, heads, kv_heads, head_dim = 8, 6, 2, 64
    prefix_blocks = 4
    lens, qlens, sharing, run = SPLIT_LAYOUTS[layout]
    q, k_cache, v_cache, tables = _random_batch(dtype, heads, kv_heads, head_dim, bs, lens, qlens)
    tables[sharing, :prefix_blocks] = tables[sharing[0], :prefix_blocks]
    qsl = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        num_tokens=sum(qlens),
        num_decodes=sum(n == 1 for n in qlens),
        block_size=bs,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(lens),
        block_tables=tables,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_start_loc_list=qsl,
        seq_lens_list=lens,
    )
    backend = cpu_backend.CpuAttentionBackend()
    backend.prepare(meta)
    shared = meta.plan_as(cpu_backend.CpuAttentionPlan).shared
    assert shared is not None and shared.tokens == prefix_blocks * bs and shared.seqs == run
    # The step's new K/V are already in the cache here: write nothing.
    backend.write_kv = lambda *args: None
    empty = torch.empty(0, kv_heads, head_dim, dtype=dtype)
    out = backend.forward(q, empty, empty, k_cache, v_cache, meta, head_dim**-0.5)
    expected, _ = reference_attention(q, k_cache, v_cache, tables, lens, qlens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_backend_generates_like_torch_backend(tiny_llama, dtype):
    """Mixed steps (prefill chunks next to decodes, prefix hits, preemption) give the same tokens
    on the native-kernel backend as on the reference backend."""
    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 30, 70)]
    prompts += [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 17, 120)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    options = {"block_size": 8, "num_kv_blocks": 48, "max_num_batched_tokens": 64}
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model=str(tiny_llama), dtype=dtype, attention_backend=backend, **options)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.num_preemptions_total > 0
    if dtype == "float32":
        assert outs["cpu"] == outs["torch"]
    else:
        # bf16 rounding may flip a late near-tie; the first tokens must agree.
        assert [o[:4] for o in outs["cpu"]] == [o[:4] for o in outs["torch"]]


@needs_compiler
def test_shared_prefix_split_generates_like_torch_backend(tiny_llama, monkeypatch):
    """Every prompt behind one system prompt: after the first step all sequences share its
    blocks, the backend takes the shared-prefix split, and greedy tokens (float32) are those of
    the reference backend."""
    from engine.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "CASCADE_MIN_PAIRS", 1)
    used = []
    merge = cpu_backend.CpuAttentionBackend._merge_shared_prefix
    monkeypatch.setattr(
        cpu_backend.CpuAttentionBackend,
        "_merge_shared_prefix",
        staticmethod(lambda *args: used.append(1) or merge(*args)),
    )
    rng = random.Random(5)
    system = [rng.randrange(3, 512) for _ in range(37)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 4, 9, 20, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend=backend, block_size=8)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert used
    assert outs["cpu"] == outs["torch"]


def test_without_native_kernel_auto_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.load.cache_clear()
    try:
        assert not native.available()
        assert select_backend("auto", torch.device("cpu"), torch.float32).name == "torch"
        with pytest.raises(ValueError, match="attention_backend: cpu"):
            select_backend("cpu", torch.device("cpu"), torch.float32)
    finally:
        native.load.cache_clear()


def test_without_compiler_native_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def _greedy_requests(n: int, **params) -> list:
    from engine.request import Request

    sp = SamplingParams(max_tokens=8, temperature=0.0, **params)
    return [Request(str(i), [1, 2, 3], sp, eos_token_ids=frozenset({2})) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_matches_float32_argmax(dtype):
    from engine.sampler import Sampler

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 1000, generator=gen).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    logits[5, :] = float("-inf")
    logits[5, 999] = 0.0
    requests = _greedy_requests(9, ignore_eos=True)
    assert Sampler._plain_greedy(requests)
    out = Sampler()(logits, requests)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[3] == 10 and out.token_ids[5] == 999
    assert (
        native.argmax_rows(logits[:, :500]).tolist() == logits[:, :500].float().argmax(-1).tolist()
    )


def test_greedy_fast_path_yields_to_min_tokens_and_logprobs():
    from engine.sampler import Sampler

    logits = torch.zeros(2, 10)
    logits[:, 2] = 5.0  # EOS is the argmax
    banned = _greedy_requests(2, min_tokens=3)
    assert not Sampler._plain_greedy(banned)
    assert 2 not in Sampler()(logits, banned).token_ids
    with_logprobs = _greedy_requests(2, logprobs=1, ignore_eos=True)
    assert not Sampler._plain_greedy(with_logprobs)
    out = Sampler()(logits, with_logprobs)
    assert out.token_ids == [2, 2] and out.logprobs[0] is not None


# Tolerance of the fused ops against the eager ones: one bf16 ulp, or float32 rounding.
FUSED_RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [64, 70], ids=["vector-width", "with-tail"])
def test_fused_elementwise_ops_match_reference_ops(width, dtype):
    from engine.model import fused
    from engine.model.layer_ops import apply_rope, rms_norm

    gen = torch.Generator().manual_seed(5)
    rtol = FUSED_RTOL[dtype]
    x = (torch.randn(7, width, generator=gen) * 3).to(dtype)
    res = torch.randn(7, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    assert fused.enabled(x)

    expected_sum = x + res
    expected = rms_norm(expected_sum, w, 1e-5)
    got = fused.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(x, expected_sum)  # the residual add happened in place
    torch.testing.assert_close(got, expected, atol=0, rtol=rtol)
    if dtype == torch.bfloat16:
        assert (got != expected).float().mean() < 0.05  # mostly the very same rounding

    # Heads of 16 take the scalar loop; of 64 (halves of 32), bf16's 16-lane one.
    for dim in (16, 64):
        heads, kv_heads = 4, 2
        qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        positions = torch.tensor([0, 1, 5, 9, 100, 3, 2])
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.arange(128).float()[:, None] * inv[None, :]
        cos_t, sin_t = freqs.cos(), freqs.sin()
        cos, sin = cos_t[positions].to(dtype).unsqueeze(1), sin_t[positions].to(dtype).unsqueeze(1)
        q_ref = apply_rope(qkv[:, : heads * dim].view(7, heads, dim), cos, sin)
        k_ref = apply_rope(
            qkv[:, heads * dim : (heads + kv_heads) * dim].view(7, kv_heads, dim), cos, sin
        )
        v_before = qkv[:, (heads + kv_heads) * dim :].clone()
        fused.rope_(qkv, positions, cos_t, sin_t, heads + kv_heads, dim)
        # bf16 rounds every op as the eager ones do (equal); float32 may fuse a multiply-add.
        exact = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
        torch.testing.assert_close(qkv[:, : heads * dim].view(7, heads, dim), q_ref, **exact)
        torch.testing.assert_close(
            qkv[:, heads * dim : (heads + kv_heads) * dim].view(7, kv_heads, dim), k_ref, **exact
        )
        assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)

    gate_up = (torch.randn(7, 2 * (width - 16), generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating and zero gates
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = fused.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, atol=1e-30, rtol=rtol)
    if dtype == torch.bfloat16:
        assert (got != expected).float().mean() < 0.05  # mostly the very same rounding


@needs_compiler
def test_fused_forward_generates_like_reference_forward(tiny_llama):
    prompts = [[5, 9, 200, 7] * k for k in (1, 5, 11)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", max_num_batched_tokens=16)
    model = llm.engine.model
    outs = {}
    for use_fused in (True, False):
        model.use_fused = use_fused
        outs[use_fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o[:6] for o in outs[True]] == [o[:6] for o in outs[False]]


@needs_compiler
@pytest.mark.parametrize(
    "march",
    [
        # No vector helpers at all: the plain C loops.
        "x86-64-v2",
        # AVX2 + FMA without AVX-512 (most laptops): the 16-lane helpers as register pairs.
        pytest.param(
            "x86-64-v3",
            marks=pytest.mark.skipif(
                not {"avx2", "fma"} <= cpu_flags(), reason="needs a CPU with AVX2 and FMA"
            ),
        ),
    ],
)
def test_portable_kernels_match_reference(monkeypatch, tmp_path, march, tiny_llama):
    """Whatever the build machine, the library built for an older CPU (no AVX-512) must agree
    with the references too: the plain C loops, and the AVX2 build of the vector code, whose
    float32 decoder stack (the path of ``dtype: auto`` there) gives the Python loop's hidden
    states bit for bit."""
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    flags = [f"-march={march}" if f == "-march=native" else f for f in native.CFLAGS]
    monkeypatch.setattr(native, "CFLAGS", flags)
    native.load.cache_clear()
    try:
        assert native.available()
        assert list(tmp_path.rglob("*.so"))  # built afresh with the portable flags
        lib = native.load()
        # Neither decode linear kernel is built without AVX512-BF16: callers take oneDNN.
        assert not lib.bf16_linear_available() and not lib.amx_linear_available()
        for dtype in (torch.float32, torch.bfloat16):
            for kv_start_blocks in (0, 1):
                test_native_attention_matches_reference(dtype, 9, 3, 64, 16, kv_start_blocks)
            test_native_kv_write_matches_index_copy(dtype)
        for dtype in (torch.bfloat16, torch.float32):
            test_fused_elementwise_ops_match_reference_ops(70, dtype)
        assert bool(lib.f32_linear_available()) == (march == "x86-64-v3")
        if march == "x86-64-v3":
            # What f32_linear_preferred answers on a CPU without AVX-512 (it is cached for
            # this machine's own build).
            monkeypatch.setattr(native, "f32_linear_preferred", lambda: True)
            _f32_stack_matches_the_loop(tiny_llama)
    finally:
        native.load.cache_clear()


def _f32_stack_matches_the_loop(model_dir) -> None:
    """A float32 step of decodes plus a short prompt chunk through the one-call stack, against
    the Python loop over the same kernels."""
    llm = LLM(model=str(model_dir), dtype="float32")
    model = llm.engine.model
    assert model.native_forward is not None
    batch = decodes_and_a_chunk(llm)
    kv = llm.engine.runner.kv_caches
    got = model.native_forward.run(batch.input_ids, batch.positions, kv, batch.meta)
    assert got is not None
    model.use_native_forward = False
    assert torch.equal(got, model(batch.input_ids, batch.positions, kv, batch.meta))


@needs_compiler
def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    """The library is compiled with -ffast-math but must not switch the process to
    flush-to-zero (gcc's crtfastmath does that when the link has -ffast-math too)."""
    assert native.available()
    tiny = float("1e-310")  # subnormal in float64
    assert tiny * 0.5 > 0.0
    t = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in float32
    assert (t * 2.0).item() > 0.0
