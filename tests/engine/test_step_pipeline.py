"""``async_scheduling``: the next step planned during each forward gives the serial loop's outputs
(greedy and seeded), through chunked prefill, prefix hits, preemption, aborts and stop strings,
and leaves every block free at the end."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time
from collections import defaultdict

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.outputs import RequestDelta
from engine.structured_output import StructuredOutputs
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens


def drain(engine: LLMEngine, max_steps: int = 2000) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        deltas += engine.step()
    raise AssertionError("engine did not drain")


def by_request(deltas: list[RequestDelta]) -> dict[str, tuple[list[int], str, str | None]]:
    """Per request: its tokens, its text and its finish reason, checking that nothing follows
    the final delta."""
    ids: dict[str, list[int]] = defaultdict(list)
    text: dict[str, str] = defaultdict(str)
    reason: dict[str, str | None] = {}
    for d in deltas:
        assert d.request_id not in reason, f"{d.request_id}: a delta after its last"
        ids[d.request_id] += d.new_token_ids
        text[d.request_id] += d.new_text
        assert d.num_output_tokens == len(ids[d.request_id])
        if d.finished:
            reason[d.request_id] = d.finish_reason
    return {r: (ids[r], text[r], reason.get(r)) for r in ids}


def assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.kv.req_blocks == {}
    assert not engine.scheduler.running and not len(engine.scheduler.waiting)


SHARED = tokens(40, 7)


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Long prompts (chunked at 32 tokens a step), a shared 40-token prefix (prefix hits), and
    staggered lengths so that requests finish at different steps."""
    reqs = []
    for i in range(10):
        prompt = (SHARED if i % 2 else []) + tokens(5 + 11 * i, 100 + i)
        params = SamplingParams(max_tokens=3 + 4 * (i % 5), temperature=0.0)
        reqs.append((f"r{i}", prompt, params))
    # Seeded sampling: each request's draws come from its own generator.
    reqs.append(("seeded", tokens(30, 200), SamplingParams(max_tokens=12, seed=5)))
    return reqs


def run(model_dir, async_scheduling: bool, **options) -> tuple[LLMEngine, dict]:
    engine = make_engine(model_dir, async_scheduling=async_scheduling, **options)
    for rid, prompt, params in workload():
        engine.add_request(rid, prompt, params)
    outputs = by_request(drain(engine))
    assert_all_blocks_free(engine)
    return engine, outputs


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-prefill-prefix-hits"),
        pytest.param(
            {"max_num_batched_tokens": 32, "block_size": 4, "num_kv_blocks": 48},
            id="preemption",
        ),
    ],
)
def test_outputs_match_the_serial_loop(tiny_llama, options):
    serial, expected = run(tiny_llama, False, **options)
    overlap, got = run(tiny_llama, True, **options)
    assert got == expected
    assert len(got) == len(workload()) and all(reason == "length" for *_, reason in got.values())
    # The paths under test were taken, by both loops.
    for engine in (serial, overlap):
        assert engine.stats.cache_hit_tokens_local > 0
        if "num_kv_blocks" in options:
            assert engine.stats.num_preemptions > 0


def test_abort_of_a_planned_request(tiny_llama):
    """An abort between steps, of a request the next step was already planned with: it runs no
    further, its blocks come back, and the others' outputs are the serial loop's."""
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_llama, async_scheduling=overlap)
        for rid, prompt, params in workload():
            engine.add_request(rid, prompt, params)
        deltas = []
        for _ in range(4):
            deltas += engine.step()
        if overlap:
            planned = engine._pipeline._next
            assert planned is not None
            assert "r3" in {r.request_id for r, _ in planned.out.scheduled}
        assert engine.abort_request("r3")
        rest = drain(engine)
        assert "r3" not in {d.request_id for d in rest}
        assert_all_blocks_free(engine)
        assert engine.stats.finished["abort"] == 1
        results[overlap] = by_request(deltas + rest)
    assert results[True] == results[False]
    assert results[True]["r3"][2] is None  # aborted: no final delta


def test_stop_strings_and_text_match_the_serial_loop(tiny_llama_with_tokenizer):
    """Stop strings end a request in the step that completes them; the step planned meanwhile
    had it scheduled, and drops it."""
    prompts = ["Once upon a time", "The capital of France", "def main():", "1, 2, 3,"]
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    engine = make_engine(tiny_llama_with_tokenizer)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, plain)
    free_text = {rid: text for rid, (_, text, _) in by_request(drain(engine)).items()}
    # A stop string from the middle of each free-running output (its characters 4..6).
    stops = {rid: text[4:7] for rid, text in free_text.items() if len(text.strip()) >= 8}
    assert len(stops) >= 2

    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_llama_with_tokenizer, async_scheduling=overlap)
        for i, p in enumerate(prompts):
            stop = [stops[str(i)]] if str(i) in stops else []
            engine.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0.0, stop=stop))
        results[overlap] = by_request(drain(engine))
        assert_all_blocks_free(engine)
    assert results[True] == results[False]
    for rid, stop in stops.items():
        ids, text, reason = results[True][rid]
        assert reason == "stop" and stop not in text
        assert free_text[rid].startswith(text)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_preparing_a_batch_off_the_engine_thread_starts_no_openmp_team(tiny_llama):
    """The planning thread builds batches; a parallel op there would start a second OpenMP team,
    and once teams outnumber the CPUs libgomp stops spinning at every barrier of the forward."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=64)
    for rid, prompt, params in workload():
        engine.add_request(rid, prompt, params)
    engine.step()  # decodes and a prefill chunk in the next batch
    out = engine.scheduler.schedule()
    assert any(n == 1 for _, n in out.scheduled) and any(n > 1 for _, n in out.scheduled)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the package's fixture runs on one
    try:
        torch.ones(256, 256) @ torch.ones(256, 256)  # this thread's team exists
        threads = set(os.listdir("/proc/self/task"))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(engine.runner.prepare, engine.scheduled_seqs(out)).result()
            # The planning thread itself, alive, and nothing else new (threads left by earlier
            # tests may end meanwhile, so this compares ids rather than counts).
            assert len(set(os.listdir("/proc/self/task")) - threads) == 1
    finally:
        torch.set_num_threads(before)


def test_grammar_penalties_and_sampling_match_the_serial_loop(tiny_llama_with_tokenizer):
    """A grammar's mask, penalties and seeded draws read the previous step's token when the step
    samples, after the planned step was built: the same choices as the serial loop."""
    params = [
        SamplingParams(
            max_tokens=24,
            temperature=1.0,
            seed=3,
            structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,6}"),
        ),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3),
        *(SamplingParams(max_tokens=10, temperature=0.8, seed=11 + k) for k in range(3)),  # n=3
    ]
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_llama_with_tokenizer, async_scheduling=overlap)
        for i, p in enumerate(params):
            engine.add_request(str(i), "Call me at", p)
        results[overlap] = by_request(drain(engine))
        assert_all_blocks_free(engine)
    assert results[True] == results[False]
    _, text, reason = results[True]["0"]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", text) and reason == "stop"


def test_a_late_request_is_rejected_by_the_step_that_reports_it(tiny_llama):
    """A request added while a step is planned is rejected when the next step runs, not by the
    planner: until then it is live, and its rejection comes back in that step's deltas."""
    engine = make_engine(
        tiny_llama, async_scheduling=True, reject_late_requests=True, max_num_seqs=1
    )
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine.add_request("ok", tokens(6, 0), params)
    engine.step()
    assert engine._pipeline._next is not None
    engine.add_request(
        "late", tokens(6, 1), params, arrival_time=time.monotonic() - 1.0, deadline_ms=5
    )
    assert "late" in engine.scheduler.requests
    deltas = engine.step()
    late = [
        (d.finished, d.finish_reason, d.new_token_ids) for d in deltas if d.request_id == "late"
    ]
    assert late == [(True, "rejected", [])]
    assert [d.request_id for d in deltas if d.request_id != "late"] == ["ok"]
    rest = drain(engine)
    assert {d.request_id for d in rest} == {"ok"}
    assert engine.stats.deadline_missed == {"rejected": 1}
    assert_all_blocks_free(engine)
