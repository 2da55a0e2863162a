"""The one-call native decoder stack against the Python loop over the same kernels."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.cpu_backend import CpuAttentionPlan
from engine.kernels import native
from engine.model.linear import decode_max_rows
from tests.helpers import decodes_and_a_chunk, make_tiny_llama, next_batch

needs_decode_kernel = pytest.mark.skipif(
    native.decode_linear_kind() is None,
    reason="needs a CPU with AMX or AVX512-BF16 (avx512_bf16) and the native kernels",
)
needs_f32_kernel = pytest.mark.skipif(
    not native.f32_linear_preferred(),
    reason="needs the float32 kernel, on a CPU where it is preferred (AVX2 without AVX-512, AMD)",
)
# Each dtype the stack runs in, skipped where its linear kernel does not run.
DTYPES = [
    pytest.param("bfloat16", marks=needs_decode_kernel),
    pytest.param("float32", marks=needs_f32_kernel),
]


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory: pytest.TempPathFactory):
    """Heads of 64 (the AMX decode attention path where AMX runs), 3 query heads per KV head,
    like SmolLM2."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("hd64"), hidden_size=384, num_heads=6, num_kv_heads=2
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["tiny", "head-dim-64"])
def test_native_stack_matches_the_python_loop_bit_for_bit(which, dtype, tiny_llama, head_dim_64):
    """A step of decodes plus a short prompt chunk (one native attention call per layer)."""
    llm = LLM(model=str(tiny_llama if which == "tiny" else head_dim_64), dtype=dtype)
    model = llm.engine.model
    assert model.native_forward is not None
    batch = decodes_and_a_chunk(llm)
    assert batch.meta.num_decodes == 3 and batch.input_ids.shape[0] == 3 + 9
    kv = llm.engine.runner.kv_caches
    got = model.native_forward.run(batch.input_ids, batch.positions, kv, batch.meta)
    assert got is not None
    model.use_native_forward = False
    expected = model(batch.input_ids, batch.positions, kv, batch.meta)
    assert got.dtype == getattr(torch, dtype) and torch.equal(got, expected)


@needs_decode_kernel
def test_steps_the_native_stack_cannot_run_fall_back(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", max_num_batched_tokens=256)
    engine, model = llm.engine, llm.engine.model
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # More rows than the decode kernels take.
    engine.add_request("long", [i % 500 + 1 for i in range(200)], params)
    batch = next_batch(llm)
    assert batch.input_ids.shape[0] > decode_max_rows()
    kv = engine.runner.kv_caches
    assert model.native_forward.run(batch.input_ids, batch.positions, kv, batch.meta) is None


@needs_decode_kernel
def test_a_prefill_chunk_runs_natively_either_way_bit_for_bit(tiny_llama):
    """A prompt of up to 100 tokens (within the decode kernels' rows: 96 with AMX, 128 with
    AVX512-BF16): one native call for the whole stack where the CPU's bf16 attention tile takes
    every chunk, else SDPA's attention between two native calls per layer; either way bit for
    bit the Python loop over the same kernels."""
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", max_num_batched_tokens=256)
    engine, model = llm.engine, llm.engine.model
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = min(100, decode_max_rows())
    engine.add_request("mid", [i % 500 + 1 for i in range(tokens)], params)
    batch = next_batch(llm)
    assert batch.input_ids.shape[0] <= decode_max_rows()
    on_sdpa = bool(batch.meta.plan_as(CpuAttentionPlan).sdpa_seqs)
    assert on_sdpa != native.bf16_prefill_preferred()
    kv = engine.runner.kv_caches
    got = model.native_forward.run(batch.input_ids, batch.positions, kv, batch.meta)
    assert got is not None
    model.use_native_forward = False
    expected = model(batch.input_ids, batch.positions, kv, batch.meta)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_prefix_split_step_runs_per_layer_bit_for_bit(dtype, head_dim_64, monkeypatch):
    """Decodes behind one cached system prompt take the backend's shared-prefix split (an SDPA
    call over the prefix, the kernel over each sequence's own keys, a merge), which is not one
    native call: each layer runs as two native calls around it, with the Python loop's hidden
    states and the loop's greedy tokens."""
    from engine.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "CASCADE_MIN_PAIRS", 1)
    system = [(11 * j) % 500 + 1 for j in range(48)]
    prompts = [system + [(5 * i + j) % 500 + 1 for j in range(3 + i)] for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(head_dim_64), dtype=dtype, block_size=16)
    engine, model = llm.engine, llm.engine.model
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    batch = next_batch(llm)
    assert batch.meta.num_decodes == len(prompts)
    assert batch.meta.plan_as(CpuAttentionPlan).shared_prefix_tokens == 48
    assert model.backend.native_step(batch.meta) is None
    kv = engine.runner.kv_caches
    got = model.native_forward.run(batch.input_ids, batch.positions, kv, batch.meta)
    assert got is not None
    model.use_native_forward = False
    assert torch.equal(got, model(batch.input_ids, batch.positions, kv, batch.meta))
    outs = {}
    for native_forward in (True, False):
        fresh = LLM(model=str(head_dim_64), dtype=dtype, block_size=16)
        fresh.engine.model.use_native_forward = native_forward
        outs[native_forward] = [o.token_ids for o in fresh.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_only_kernel_packed_bias_free_models_get_the_native_stack(tiny_llama, tmp_path):
    bf16 = LLM(model=str(tiny_llama), dtype="bfloat16").engine.model
    assert (bf16.native_forward is not None) == (native.decode_linear_kind() is not None)
    f32 = LLM(model=str(tiny_llama), dtype="float32").engine.model
    assert (f32.native_forward is not None) == native.f32_linear_preferred()
    qwen2 = make_tiny_llama(tmp_path / "qwen2", model_type="qwen2")  # q/k/v biases
    for dtype in ("bfloat16", "float32"):
        assert LLM(model=str(qwen2), dtype=dtype).engine.model.native_forward is None
    unpacked = LLM(model=str(tiny_llama), dtype="bfloat16", prepack_weights=False)
    assert unpacked.engine.model.native_forward is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_stack_generates_the_python_loops_tokens(dtype, tiny_llama):
    """Greedy generation, prefills and decodes of several lengths: token for token the Python
    loop over the same kernels, and the first tokens of the reference ops (F.linear / oneDNN,
    eager elementwise ops), as the fused path's own test checks."""
    prompts = [[5, 9, 200, 7] * k for k in (1, 5, 11)] + [[3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_llama), dtype=dtype, max_num_batched_tokens=64)
    model = llm.engine.model
    assert model.native_forward is not None
    calls = []
    run = model.native_forward.run

    def counting_run(*args, **kwargs):
        out = run(*args, **kwargs)
        calls.append(out is not None)
        return out

    model.native_forward.run = counting_run
    native_out = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(calls) >= 20  # the decode steps took the native stack
    model.use_native_forward = False
    loop_out = [o.token_ids for o in llm.generate(prompts, params)]
    assert native_out == loop_out
    model.use_fused = False
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o[:6] for o in native_out] == [o[:6] for o in reference]
