"""Decode graphs (``engine.cuda_graph``). On CPU the capture is replaced by one that reruns
the captured function into the same static output, so padding, the static buffers, the scratch
block and which steps qualify are checked here; the last test captures real CUDA graphs where a
GPU is present.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import SamplingParams
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan
from engine.cuda_graph import (
    Captured,
    CudaGraphCapture,
    GraphCapture,
    graph_sizes,
    use_cuda_graphs,
)
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner, ScheduledSeq
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens

BLOCK = 8


class RerunCapture:
    """Records each captured function and, on replay, reruns it into the captured output (what
    a CUDA graph does, minus the graph)."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        self.captured += 1
        output = fn()

        def replay() -> None:
            output.copy_(fn())

        return Captured(replay, output)


class GraphSafeBackend(TorchAttentionBackend):
    """The torch backend with a decode plan made from tensors and shapes only (no Python list
    of the metadata, no host read), as a graph-safe backend must be."""

    supports_cuda_graphs = True

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.num_decodes != meta.num_tokens:
            super().prepare(meta)
            return
        tables = meta.block_tables
        span = tables.shape[1] * meta.block_size
        keys = torch.arange(span, device=tables.device)[None, :] < meta.seq_lens[:, None]
        meta.plan = TorchAttentionPlan(tables, keys[:, None, None, :])


def swap_runner(
    engine: LLMEngine,
    graphs: bool,
    max_num_seqs: int = 4,
    capture: GraphCapture | None = None,
) -> GraphCapture | None:
    """Give ``engine`` a runner over GraphSafeBackend and the reference ops (what CUDA runs),
    capturing decode graphs up to ``max_num_seqs`` when ``graphs`` (with ``capture``, by
    default a RerunCapture)."""
    backend = GraphSafeBackend()
    engine.model.backend = backend
    engine.model.use_fused = False
    if graphs and capture is None:
        capture = RerunCapture()
    if not graphs:
        capture = None
    engine.runner = ModelRunner(
        engine.model,
        engine.model_cfg,
        backend,
        engine.num_blocks,
        engine.config.block_size,
        engine.device,
        engine.dtype,
        engine.sampler,
        capture=capture,
        max_num_seqs=max_num_seqs,
        max_model_len=engine.max_model_len,
    )
    return capture


def generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    params: list[SamplingParams] | None = None,
) -> list[list[int]]:
    """Each prompt's output tokens (greedy unless ``params`` give each prompt's)."""
    for i, prompt in enumerate(prompts):
        p = params[i] if params else SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(str(i), prompt, p)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_sizes_follow_the_ladder_up_to_max_num_seqs():
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_graphs_only_on_cuda_with_a_graph_safe_backend_and_not_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    safe, unsafe = GraphSafeBackend(), TorchAttentionBackend()
    assert use_cuda_graphs(cuda, safe, enforce_eager=False)
    assert not use_cuda_graphs(cuda, safe, enforce_eager=True)
    assert not use_cuda_graphs(cuda, unsafe, enforce_eager=False)
    assert not use_cuda_graphs(cpu, safe, enforce_eager=False)
    assert AttentionBackend.__dict__.get("supports_cuda_graphs", False) is False


def test_cpu_engine_captures_nothing(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=32, enforce_eager=False)
    assert engine.runner.graphs is None
    assert engine.runner.kv_caches[0][0].shape[0] == 32
    generate(engine, [tokens(5, 0)], max_tokens=3)
    assert engine.runner.graph_replays == 0


def test_graph_decode_equals_eager_and_leaves_real_blocks_alone(tiny_llama):
    """Greedy tokens and every pool block's KV equal the eager runner's, for batches padded
    from 3 to 4 rows and from 1 to 1; padding writes only the scratch block."""
    prompts = [tokens(n, seed) for seed, n in enumerate((5, 13, 21))]
    results = []
    for graphs in (False, True):
        engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=32)
        capture = swap_runner(engine, graphs)
        runner = engine.runner
        if capture is not None:
            assert capture.captured == len(graph_sizes(4))
            # One scratch block past the pool's 32; the pool never hands it out.
            assert runner.kv_caches[0][0].shape[0] == 33
            assert runner.graphs is not None and runner.graphs.scratch_block == 32
            assert engine.kv.pool.num_blocks == 32
            assert max(b.block_id for b in engine.kv.pool.blocks) == 31
        # A fourth request, alone at the end, decodes in a batch of one.
        outs = generate(engine, prompts, max_tokens=6) + generate(engine, [tokens(7, 9)], 4)
        if runner.graphs is not None:
            # The last step decoded one row: every other row is padding, in the scratch block.
            assert runner.graphs.block_tables[1:].eq(32).all()
            assert runner.graphs.block_tables[0, 2:].eq(32).all()  # 10 tokens: 2 blocks
        results.append((outs, runner.read_blocks(list(range(32))), runner.graph_replays))
    (eager, eager_kv, eager_replays), (graph, graph_kv, replays) = results
    assert graph == eager
    assert all(len(t) == n for t, n in zip(graph, (6, 6, 6, 4), strict=True))
    torch.testing.assert_close(graph_kv, eager_kv, atol=1e-5, rtol=1e-5)
    assert eager_replays == 0
    # 5 decode steps for the three, 3 for the last one: each replayed a graph.
    assert replays == 5 + 3


def test_logits_equal_eager_for_each_padded_size(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=64)
    swap_runner(engine, graphs=True, max_num_seqs=8)
    runner, graphs = engine.runner, engine.runner.graphs
    assert graphs is not None
    requests = []
    for i in range(7):
        r = engine.add_request(str(i), tokens(3 + 4 * i, i), SamplingParams(temperature=0.0))
        assert engine.kv.allocate_slots(r, r.num_prompt_tokens)
        requests.append(r)
    prefill = [
        ScheduledSeq(r, r.num_prompt_tokens - 1, engine.kv.block_ids(r.request_id))
        for r in requests
    ]
    with torch.inference_mode():
        runner.run(runner.prepare(prefill))
    # Each batch below decodes the last prompt token of its first n requests (one query row each).
    for n in (1, 3, 5, 7):
        seqs = [ScheduledSeq(r, 1, engine.kv.block_ids(r.request_id)) for r in requests[:n]]
        for r in requests[:n]:
            r.num_computed_tokens = r.num_prompt_tokens - 1
        batch = runner.prepare(seqs)
        # A step that replays a graph leaves the eager metadata unprepared.
        assert batch.meta.plan is None
        engine.model.backend.prepare(batch.meta)
        with torch.inference_mode():
            hidden = engine.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
            eager = engine.model.compute_logits(hidden)
            logits = graphs.run(batch.input_ids, batch.positions, batch.meta)
        assert logits is not None and logits.shape == eager.shape
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
        size = graphs.size_for(n)
        assert graphs.input_ids[n:size].eq(0).all() and graphs.seq_lens[n:size].eq(1).all()
        assert graphs.slot_mapping[n:size].eq(graphs.scratch_block * BLOCK).all()


def test_steps_that_do_not_qualify_run_eagerly(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=64)
    swap_runner(engine, graphs=True, max_num_seqs=2)
    graphs = engine.runner.graphs
    assert graphs is not None
    rs = []
    for i in range(3):
        r = engine.add_request(str(i), tokens(4, i), SamplingParams(temperature=0.0))
        assert engine.kv.allocate_slots(r, 5)
        rs.append(r)
    ids = {r.request_id: engine.kv.block_ids(r.request_id) for r in rs}
    # A prefill chunk beside a decode: not pure decode.
    rs[0].num_computed_tokens = 3
    mixed = engine.runner.prepare(
        [ScheduledSeq(rs[0], 1, ids["0"]), ScheduledSeq(rs[1], 4, ids["1"])]
    )
    assert graphs.run(mixed.input_ids, mixed.positions, mixed.meta) is None
    # Three decodes: more than the largest graph (2).
    for r in rs:
        r.num_computed_tokens = 3
    wide = engine.runner.prepare([ScheduledSeq(r, 1, ids[r.request_id]) for r in rs])
    assert graphs.run(wide.input_ids, wide.positions, wide.meta) is None
    assert graphs.replays == 0
    # Prompt logprobs need the prompt rows' hidden states: the runner runs such a step eagerly.
    two = engine.add_request("two", [5, 6, 7], SamplingParams(temperature=0.0, prompt_logprobs=1))
    assert engine.kv.allocate_slots(two, 2)
    two.num_computed_tokens = 1
    batch = engine.runner.prepare([ScheduledSeq(two, 1, engine.kv.block_ids("two"))])
    assert batch.prompt_rows and batch.meta.num_decodes == 1
    step = engine.runner.run(batch)
    assert graphs.replays == 0 and len(step.prompt_logprobs) == 1


def test_decode_rows_that_do_not_sample_are_left_out(tiny_llama):
    """A one-token chunk in the middle of a prompt rides in a pure-decode step without
    sampling: the graph runs, and only the other row's logits reach the sampler."""
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=64)
    swap_runner(engine, graphs=True, max_num_seqs=4)
    runner = engine.runner
    done = engine.add_request("done", tokens(6, 1), SamplingParams(temperature=0.0))
    mid = engine.add_request("mid", tokens(5, 2), SamplingParams(temperature=0.0))
    assert engine.kv.allocate_slots(done, 6) and engine.kv.allocate_slots(mid, 5)
    first = [ScheduledSeq(done, 5, engine.kv.block_ids("done"))]
    with torch.inference_mode():
        runner.run(runner.prepare(first))
    done.num_computed_tokens = 5
    seqs = [
        ScheduledSeq(done, 1, engine.kv.block_ids("done")),
        ScheduledSeq(mid, 1, engine.kv.block_ids("mid")),
    ]
    batch = runner.prepare(seqs)
    assert batch.meta.num_decodes == 2 and batch.sample_requests == [done]
    assert batch.meta.plan is None
    engine.model.backend.prepare(batch.meta)
    with torch.inference_mode():
        hidden = engine.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
        expected = engine.model.compute_logits(hidden[:1]).argmax(-1).tolist()
        step = runner.run(batch)
    assert runner.graph_replays == 1
    assert step.sampled == [done] and step.sampler.token_ids == expected


class FailingCapture:
    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_is_logged_and_the_engine_runs_eagerly(tiny_llama, caplog):
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=32)
    expected = generate(engine, [tokens(6, 4)], max_tokens=3)
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=32)
    with caplog.at_level("ERROR", logger="engine.model_runner"):
        swap_runner(engine, graphs=True, capture=FailingCapture())
    assert engine.runner.graphs is None
    assert "decode graphs are off" in caplog.text
    assert "capturing batch size 4 with the torch attention backend failed" in caplog.text
    assert generate(engine, [tokens(6, 4)], max_tokens=3) == expected
    assert engine.runner.graph_replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_equal_eager_on_cuda(tiny_llama):
    """Real capture and replay on a GPU (float32, the reference ops and a graph-safe decode
    plan): the tokens of greedy and of seeded / unseeded sampled requests with filters,
    penalties and logprobs equal the eager engine's; the pool's blocks hold the same KV."""
    prompts = [tokens(n, seed) for seed, n in enumerate((5, 13, 21, 2, 40))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=4, repetition_penalty=1.2, max_tokens=12),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=12),
        SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=12),
    ]
    results = []
    for graphs in (False, True):
        engine = make_engine(
            tiny_llama, block_size=16, num_kv_blocks=32, device="cuda", max_num_seqs=8
        )
        assert engine.device.type == "cuda"
        capture = CudaGraphCapture(engine.device) if graphs else None
        swap_runner(engine, graphs, max_num_seqs=8, capture=capture)
        outs = generate(engine, prompts, 12, params) + generate(engine, [tokens(9, 9)], 5)
        kv = engine.runner.read_blocks(list(range(32))).cpu()
        results.append((outs, kv, engine.runner.graph_replays))
        pool = engine.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
    (eager, eager_kv, eager_replays), (graph, graph_kv, replays) = results
    print(f"eager tokens {eager}\ngraph tokens {graph}\ngraph replays {replays}")
    assert eager_replays == 0 and replays >= 11 + 4
    assert graph == eager
    torch.testing.assert_close(graph_kv, eager_kv, atol=1e-4, rtol=1e-4)
