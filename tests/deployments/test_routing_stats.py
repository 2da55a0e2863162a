"""An engine replica's routing-stats snapshot of a real engine, read back as the router reads it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from deployments.routing_stats import routing_snapshot
from engine import SamplingParams
from engine.block_hash import compute_block_hashes
from router.report import ReplicaReport
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens


def test_the_router_reads_what_the_engine_holds(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, block_size=16)
    prompt = tokens(40, 5)
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # the prompt's prefill: its two full blocks are cached, the request runs
    for rid, seed in (("b", 6), ("c", 7)):
        engine.add_request(rid, tokens(20, seed), SamplingParams(max_tokens=2, ignore_eos=True))
    before = time.time()
    stats = routing_snapshot(engine, "r1", 12.5, "node-1", None)
    report = ReplicaReport.from_dict(stats)
    assert before <= report.reported_at <= time.time()
    assert (report.replica_id, report.started_at, report.node_id) == ("r1", 12.5, "node-1")
    assert report.block_size == 16
    assert (report.num_running, report.num_waiting) == (1, 2)
    assert report.num_pending_prefill_tokens == 40
    assert report.kv_total_blocks == engine.kv.pool.num_blocks
    assert 0 < report.kv_free_blocks < report.kv_total_blocks
    prompt_blocks = compute_block_hashes(prompt, 16, engine.hash_root(None))
    assert set(prompt_blocks[:2]) <= report.cached_block_hashes
    # Without KV sharing the router has no transfer cost to price a directory hit at.
    assert report.transfer_cost_ratio is None and report.cross_node_transfer_cost_ratio is None


def test_kv_sharing_reports_its_measured_cost_ratios(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, block_size=16)
    sharing = SimpleNamespace(transfer_cost_ratios=lambda: (0.25, 0.75))
    report = ReplicaReport.from_dict(routing_snapshot(engine, "r1", 0.0, "n", sharing))  # type: ignore[arg-type]
    assert (report.transfer_cost_ratio, report.cross_node_transfer_cost_ratio) == (0.25, 0.75)
    assert report.cached_block_hashes == frozenset()


def test_the_decode_step_time_is_reported_while_sequences_run(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, block_size=16)
    engine.add_request("a", tokens(20, 8), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):  # the prefill, then decodes
        engine.step()
    report = ReplicaReport.from_dict(routing_snapshot(engine, "r1", 0.0, "n", None))
    assert report.decode_step_s == engine.stats.decode_step_s
    assert report.decode_step_s is not None and report.decode_step_s > 0
    while engine.has_unfinished_requests():
        engine.step()
    # Nothing runs: a new stream would decode alone, whatever the last figure was.
    assert (
        ReplicaReport.from_dict(routing_snapshot(engine, "r1", 0.0, "n", None)).decode_step_s
        is None
    )
