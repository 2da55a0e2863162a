"""ModelRunner: which requests sample, where KV lands, and moving KV blocks in and out."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.model_runner import ScheduledSeq
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens


def test_only_sequences_reaching_their_end_sample(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8)
    a = engine.add_request("a", tokens(20, 0), SamplingParams(temperature=0.0))
    b = engine.add_request("b", tokens(3, 1), SamplingParams(temperature=0.0))
    c = engine.add_request("c", tokens(1, 2), SamplingParams(temperature=0.0))
    for request, n in ((a, 12), (b, 3), (c, 1)):
        assert engine.kv.allocate_slots(request, n)
    seqs = [
        ScheduledSeq(r, n, engine.kv.block_ids(r.request_id)) for r, n in ((a, 12), (b, 3), (c, 1))
    ]
    step = engine.runner.execute(seqs)
    sampled, out = step.sampled, step.sampler
    # a's chunk stops short of its prompt's end; c (one token) is batched as a decode.
    assert sorted(r.request_id for r in sampled) == ["b", "c"]
    assert len(out.token_ids) == 2


def test_chunked_prefill_writes_the_same_kv_as_one_pass(tiny_llama):
    prompt = tokens(30, 3)
    caches = []
    for budget in (2048, 7):
        engine = make_engine(tiny_llama, block_size=8, max_num_batched_tokens=budget)
        engine.add_request("a", prompt, SamplingParams(max_tokens=1))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        assert steps == (1 if budget == 2048 else 5)
        # The request held blocks 0..3 of a fresh pool; freed blocks keep their KV.
        caches.append(engine.runner.read_blocks([0, 1, 2, 3]))
    one_pass, chunked = caches
    torch.testing.assert_close(chunked[:, :, :3], one_pass[:, :, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[:, :, 3, :6], one_pass[:, :, 3, :6], atol=1e-5, rtol=1e-5)


def test_read_and_write_blocks_round_trip(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_kv_blocks=8)
    runner = engine.runner
    before = runner.read_blocks(list(range(8)))
    cfg = engine.model_cfg
    assert before.shape == (cfg.num_layers, 2, 8, 4, cfg.num_kv_heads, cfg.head_dim)
    data = torch.randn(cfg.num_layers, 2, 2, 4, cfg.num_kv_heads, cfg.head_dim)
    runner.write_blocks([5, 2], data)
    torch.testing.assert_close(runner.read_blocks([5, 2]), data)
    after = runner.read_blocks(list(range(8)))
    untouched = [0, 1, 3, 4, 6, 7]
    torch.testing.assert_close(after[:, :, untouched], before[:, :, untouched])


def test_transferred_blocks_serve_as_a_prefix(tiny_llama):
    """KV written into another engine's blocks (as a replica would receive it) gives the same
    continuation as computing it."""
    prompt = tokens(40, 4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    src = make_engine(tiny_llama, block_size=8)
    src.add_request("a", prompt, params)
    expected = []
    while src.has_unfinished_requests():
        expected += [t for d in src.step() for t in d.new_token_ids]
    data = src.runner.read_blocks([0, 1, 2, 3])

    dst = make_engine(tiny_llama, block_size=8)
    request = dst.add_request("a", prompt, params)
    blocks = dst.kv.pool.allocate(4)
    dst.runner.write_blocks([b.block_id for b in blocks], data)
    for block, block_hash in zip(blocks, request.block_hashes[:4], strict=True):
        assert dst.kv.pool.cache_block(block, block_hash)
    dst.kv.pool.free(reversed(blocks))
    got = []
    while dst.has_unfinished_requests():
        got += [t for d in dst.step() for t in d.new_token_ids]
    assert request.num_cached_tokens == 32
    assert got == expected


def test_the_last_layer_runs_only_for_the_rows_that_sample(tiny_llama):
    """A chunk that samples a few of its rows gets those rows' hidden states as the full
    forward computes them, and writes the same KV for every token."""
    outputs = []
    for prune in (False, True):
        engine = make_engine(tiny_llama, block_size=8)
        runner = engine.runner
        requests = [
            engine.add_request(name, tokens(n, seed), SamplingParams(temperature=0.0))
            for name, n, seed in (("a", 20, 0), ("b", 13, 1), ("c", 9, 2))
        ]
        for r in requests:
            assert engine.kv.allocate_slots(r, r.num_tokens)
        batch = runner.prepare(
            [ScheduledSeq(r, r.num_tokens, engine.kv.block_ids(r.request_id)) for r in requests]
        )
        keep = batch.logits_indices if prune else None
        with torch.inference_mode():
            hidden = runner.model(
                batch.input_ids, batch.positions, runner.kv_caches, batch.meta, keep
            )
        if prune:
            assert hidden.shape[0] == 3 < batch.input_ids.numel()
        else:
            hidden = hidden[batch.logits_indices]
        outputs.append((hidden, runner.read_blocks(list(range(6)))))
    (full, full_kv), (pruned, pruned_kv) = outputs
    torch.testing.assert_close(pruned, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pruned_kv, full_kv)


def test_a_chunk_that_samples_nothing_still_writes_its_kv(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8)
    runner = engine.runner
    a = engine.add_request("a", tokens(24, 5), SamplingParams(temperature=0.0))
    assert engine.kv.allocate_slots(a, 16)
    batch = runner.prepare([ScheduledSeq(a, 16, engine.kv.block_ids("a"))])
    assert batch.logits_indices.numel() == 0
    before = runner.read_blocks([0, 1])
    with torch.inference_mode():
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.meta, batch.logits_indices
        )
    assert hidden.shape[0] == 0
    assert not torch.equal(runner.read_blocks([0, 1]), before)
