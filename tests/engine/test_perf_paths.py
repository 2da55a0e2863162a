"""Fast paths against their reference paths: the native paged decode kernel vs a plain softmax
over each sequence's tokens, the ``cpu`` attention backend vs the pure-PyTorch one, and the
fallbacks when the kernel cannot be built."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import native
from engine.attention.base import select_backend

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="the native kernel needs a C compiler",
)


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """Attention of one query token per sequence over its first ``lens[s]`` cached tokens."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = []
    for s in range(num_seqs):
        n = int(lens[s])
        blocks = tables[s, : -(-n // block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        qs = q[s].float().view(num_kv_heads, group, head_dim)
        p = (torch.einsum("hgd,thd->hgt", qs, k) * scale).softmax(-1)
        out.append(torch.einsum("hgt,thd->hgd", p, v).reshape(num_heads, head_dim))
    return torch.stack(out)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 64, 8), (8, 1, 64, 16), (4, 2, 16, 4), (6, 3, 32, 16)],
    ids=["smollm2", "mha", "group8", "small-dim", "dim32"],
)
def test_native_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    assert native.available()
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_seqs, max_blocks = 96, 7, 12
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(
        num_seqs, max_blocks
    )
    # Lengths of 1, exactly a block, one past a block, and a full table.
    lens = torch.tensor(
        [
            1,
            block_size,
            block_size + 1,
            3,
            2 * block_size - 1,
            5 * block_size + 2,
            max_blocks * block_size,
        ],
        dtype=torch.int64,
    )
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    native.paged_decode_attention(q, k_cache, v_cache, tables, lens, out, head_dim**-0.5)
    expected = reference_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_compiler
def test_native_decode_writes_into_strided_rows():
    """``out`` may be a row slice of a larger batch tensor (decodes first, prefills after)."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, 4, 2, 64, generator=gen)
    v_cache = torch.randn(8, 4, 2, 64, generator=gen)
    tables = torch.tensor([[3, 1], [0, 7]])
    lens = torch.tensor([6, 8])
    q_all = torch.randn(5, 4, 64, generator=gen)
    out_all = torch.zeros(5, 4, 64)
    native.paged_decode_attention(q_all[:2], k_cache, v_cache, tables, lens, out_all[:2], 0.125)
    expected = reference_decode(q_all[:2], k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out_all[:2], expected, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out_all[2:]) == 0


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


@needs_compiler
def test_fused_elementwise_ops_match_reference_ops():
    from engine.model import fused
    from engine.model.llama import apply_rope, rms_norm

    gen = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    x = (torch.randn(7, 64, generator=gen) * 3).to(bf)
    res = torch.randn(7, 64, generator=gen).to(bf)
    w = torch.randn(64, generator=gen).to(bf)
    assert fused.enabled(x)

    expected_sum = x + res
    expected = rms_norm(expected_sum, w, 1e-5)
    got = fused.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(x, expected_sum)  # the residual add happened in place
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-2)  # at most one bf16 ulp
    assert (got != expected).float().mean() < 0.05

    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, generator=gen).to(bf)
    positions = torch.tensor([0, 1, 5, 9, 100, 3, 2])
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(128).float()[:, None] * inv[None, :]
    cos_t, sin_t = freqs.cos(), freqs.sin()
    cos, sin = cos_t[positions].to(bf).unsqueeze(1), sin_t[positions].to(bf).unsqueeze(1)
    q_ref = apply_rope(qkv[:, : heads * dim].view(7, heads, dim), cos, sin)
    k_ref = apply_rope(
        qkv[:, heads * dim : (heads + kv_heads) * dim].view(7, kv_heads, dim), cos, sin
    )
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    fused.rope_(qkv, positions, cos_t, sin_t, heads + kv_heads, dim)
    assert torch.equal(qkv[:, : heads * dim].view(7, heads, dim), q_ref)
    assert torch.equal(qkv[:, heads * dim : (heads + kv_heads) * dim].view(7, kv_heads, dim), k_ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)

    gate_up = (torch.randn(7, 2 * 48, generator=gen) * 4).to(bf)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = fused.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-2)


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
