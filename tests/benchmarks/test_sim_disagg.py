"""The simulator's prefill/decode disaggregation and inter-token latency: known answers on
hand-made requests, worked out from the step-cost model by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import simulate
from benchmarks.sim.cluster import Cluster, ClusterConfig, ClusterRun
from benchmarks.sim.disagg import DisaggregatedCluster, DisaggregatedRun, make_cluster
from benchmarks.sim.metrics import itls, summarize_run
from benchmarks.sim.profile import Profile, StepCost
from benchmarks.sim.trace import SimRequestSpec

BLOCK = 16
COST = StepCost(base_s=0.001, prefill_token_s=1e-5, decode_seq_s=2e-4, decode_ctx_token_s=1e-7)
# Fetching KV: 0.5 ms, then 0.3 ms per 16-token block.
PROFILE = Profile("test", COST, transfer_base_s=5e-4, transfer_block_s=3e-4)


def _spec(i: int, arrival: float, prompt: int, output: int, first_id: int = 1) -> SimRequestSpec:
    """A request whose full prompt blocks have ids ``first_id, first_id + 1, ...``."""
    ids = tuple(range(first_id, first_id + prompt // BLOCK))
    return SimRequestSpec(i, arrival, prompt, output, ids)


def _config(replicas: int, capacity_blocks: int = 1000, **kw: object) -> ClusterConfig:
    return ClusterConfig(
        replicas=replicas, capacity_blocks=capacity_blocks, block_tokens=BLOCK, **kw
    )  # type: ignore[arg-type]


def _disagg(
    specs: list[SimRequestSpec], replicas: int, prefill: int, **kw: object
) -> DisaggregatedRun:
    return DisaggregatedCluster(PROFILE, _config(replicas, **kw), prefill).run(specs)


def _prefill_s(n: int, done: int) -> float:
    """One prefill chunk of ``n`` tokens after ``done`` computed ones (no decodes)."""
    return COST.step_s(n, n * (done + (n + 1) / 2), 0, 0)


def _decode_s(*contexts: int) -> float:
    return COST.step_s(0, 0.0, len(contexts), sum(contexts))


def test_first_token_on_a_prefill_replica_then_decodes_after_the_handoff() -> None:
    # 100 prompt tokens: 6 full blocks and 4 tokens; 5 output tokens.
    run = _disagg([_spec(0, 0.0, 100, 5)], replicas=2, prefill=1)
    (request,) = run.requests
    (handoff,) = run.handoffs
    assert run.prefill_ids == ["replica-0"] and run.decode_ids == ["replica-1"]
    assert request.replica == "replica-0" and handoff.decode_replica == "replica-1"
    t1 = _prefill_s(100, 0)  # the whole prompt and the first token, on the prefill replica
    assert request.first_token_time == pytest.approx(t1)
    assert handoff.ready_at == pytest.approx(t1) and handoff.placed_at == pytest.approx(t1)
    # The decode replica caches nothing: all 6 full blocks travel.
    assert handoff.blocks == 6
    joined = t1 + 5e-4 + 6 * 3e-4
    assert handoff.joined_at == pytest.approx(joined)
    cont = handoff.continuation
    assert cont is not None and cont.num_prompt_tokens == 101
    # It hits the 96 imported tokens and computes the partial block plus the first token (5).
    assert cont.num_cached_tokens == 96
    t2 = joined + _prefill_s(5, 96)
    t3 = t2 + _decode_s(102)
    t4 = t3 + _decode_s(103)
    t5 = t4 + _decode_s(104)
    assert request.token_times == pytest.approx([t1, t2, t3, t4, t5])
    assert request.finish_time == pytest.approx(t5) and request.num_output_tokens == 5
    # The prefill replica ran one step, the decode replica the other four.
    assert [r.num_steps for r in run.replicas] == [1, 4]
    summary = summarize_run(run)
    assert summary["completed"] == 1 and summary["output_tokens"] == 5
    assert summary["itl_ms"]["max"] == pytest.approx((t2 - t1) * 1000)
    assert all(r.kv.pool.num_free_blocks == 1000 for r in run.replicas)  # nothing leaked


def test_colocated_itl_is_the_decode_steps() -> None:
    run = Cluster(PROFILE, _config(1)).run([_spec(0, 0.0, 100, 4)])
    (request,) = run.requests
    t1 = _prefill_s(100, 0)
    gaps = [_decode_s(101), _decode_s(102), _decode_s(103)]
    assert request.token_times == pytest.approx(list(np.cumsum([t1, *gaps])))
    assert itls(run.requests) == pytest.approx(gaps)
    assert summarize_run(run)["itl_ms"]["p50"] == pytest.approx(gaps[1] * 1000)


def test_one_output_token_needs_no_handoff() -> None:
    run = _disagg([_spec(0, 0.0, 100, 1)], replicas=2, prefill=1)
    assert run.handoffs == []
    assert run.requests[0].finish_time == pytest.approx(_prefill_s(100, 0))
    assert summarize_run(run)["itl_ms"]["p50"] is None


def _stream_gaps(run: ClusterRun) -> list[float]:
    """Gaps between the tokens of the streaming request (index 0) after its second token."""
    times = run.requests[0].token_times
    return list(np.diff(times[1:]))


def test_a_long_prompt_stalls_a_colocated_stream_but_not_a_disaggregated_one() -> None:
    # A decodes 40 tokens; 10 ms in, B brings a 1,500-token prompt (a 16 ms prefill step).
    specs = [_spec(0, 0.0, 20, 40), _spec(1, 0.010, 1500, 2, first_id=100)]
    colocated = Cluster(PROFILE, _config(1)).run(specs)
    disaggregated = _disagg(specs, replicas=2, prefill=1)
    alone = _decode_s(60)  # one of A's decode steps alone, at about its longest context
    # Colocated, one of A's gaps holds B's whole prefill.
    assert max(_stream_gaps(colocated)) > _prefill_s(1500, 0)
    # Disaggregated, A's decode replica only ever batches B's short tail with A's decode.
    assert max(_stream_gaps(disaggregated)) < 2 * alone
    assert max(_stream_gaps(disaggregated)) < _prefill_s(1500, 0) / 5
    # B's first token came from the prefill replica either way, after the same prefill.
    b = disaggregated.requests[1]
    assert b.replica == "replica-0" and disaggregated.handoffs[1].decode_replica == "replica-1"
    assert b.first_token_time == pytest.approx(0.010 + _prefill_s(1500, 0))


def test_a_handoff_waits_until_the_decode_replica_can_hold_it() -> None:
    # Footprints of 12 blocks (150 + 40 tokens) on 20-block replicas: one at a time.
    specs = [_spec(0, 0.0, 150, 40), _spec(1, 0.0001, 150, 40, first_id=100)]
    run = _disagg(specs, replicas=2, prefill=1, capacity_blocks=20)
    first, second = run.handoffs
    assert first.placed_at == pytest.approx(first.ready_at)
    assert second.ready_at < run.requests[0].finish_time  # ready while the first decodes ...
    assert second.placed_at == pytest.approx(run.requests[0].finish_time)  # ... placed after
    assert all(r.num_preemptions == 0 for r in run.requests)
    assert run.install_failures == 0
    assert all(r.num_output_tokens == 40 for r in run.requests)
    wait = summarize_run(run)["itl_ms"]["max"]
    assert wait == pytest.approx(
        (second.joined_at - second.ready_at) * 1000 + _prefill_s(7, 144) * 1000
    )


def test_a_handoff_prefers_the_decode_replica_that_caches_its_prefix() -> None:
    # r0 and r1 decode side by side on the two decode replicas; r2 comes after both finished
    # and extends r1's prompt by two blocks: it goes where r1's blocks are, and fetches two.
    specs = [
        _spec(0, 0.0, 100, 3, first_id=1),
        _spec(1, 0.0, 100, 3, first_id=100),
        _spec(2, 1.0, 132, 3, first_id=100),
    ]
    run = _disagg(specs, replicas=3, prefill=1)
    assert [h.decode_replica for h in run.handoffs] == ["replica-1", "replica-2", "replica-2"]
    assert [h.blocks for h in run.handoffs] == [6, 6, 2]


def test_without_the_flag_the_cluster_is_colocated(tmp_path: Path) -> None:
    assert type(make_cluster(PROFILE, _config(2))) is Cluster
    with pytest.raises(ValueError, match="prefill replicas"):
        DisaggregatedCluster(PROFILE, _config(2), 2)
    records = [
        {"timestamp": 100 * i, "input_length": 700, "output_length": 6,
         "hash_ids": [i % 3, 10 + i, 2000 + i]}
        for i in range(24)
    ]  # fmt: skip
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    profile = tmp_path / "p.json"
    PROFILE.save(profile)
    common = ["--trace", str(trace), "--profile", str(profile), "--block-tokens", "16", "--quiet"]
    plain = simulate.main([*common, "--sweep", "2,4"])
    both = simulate.main([*common, "--sweep", "2,4", "--disaggregated", "0,1/2"])
    assert [(r["replicas"], r.get("prefill_replicas")) for r in both["runs"]] == [
        (2, None), (2, 1), (4, None), (4, 2)
    ]  # fmt: skip

    def numbers(run: dict) -> dict:
        return {k: v for k, v in run.items() if k != "sim_wall_s"}

    # "0" in the list is the run without the flag, number for number, ITL included.
    assert numbers(both["runs"][0]) == numbers(plain["runs"][0])
    assert numbers(both["runs"][2]) == numbers(plain["runs"][1])
    assert "disaggregation" not in plain["runs"][0] and plain["runs"][0]["itl_ms"]["p50"] > 0
    disagg = both["runs"][3]["disaggregation"]
    assert disagg["handoffs"] == 24 and disagg["decode_replicas"] == 2
    assert both["runs"][3]["completed"] == 24
    with pytest.raises(SystemExit, match="no decode replica"):
        simulate.main([*common, "--replicas", "2", "--disaggregated", "2"])
    with pytest.raises(SystemExit):
        simulate.main([*common, "--disaggregated", "3/2"])


def test_the_install_does_not_evict_the_prompt_blocks_the_decoder_already_holds() -> None:
    # On a 30-block decode replica, r0 leaves its 6 prompt blocks cached and r1 pushes them to
    # the head of the eviction queue. r2 extends r0's prompt by 8 blocks: installing those 8
    # would evict r0's blocks from the head, but they are pinned, so r2 hits its whole prompt.
    specs = [
        _spec(0, 0.0, 100, 3, first_id=1),
        _spec(1, 1.0, 300, 3, first_id=100),
        SimRequestSpec(2, 2.0, 228, 3, tuple(range(1, 7)) + tuple(range(200, 208))),
    ]
    run = _disagg(specs, replicas=2, prefill=1, capacity_blocks=30)
    last = run.handoffs[2]
    assert last.blocks == 8  # the 6 blocks r0 left there do not travel
    assert last.continuation is not None and last.continuation.num_cached_tokens == 14 * BLOCK
    assert run.install_failures == 0
    decode = run.replicas[1].kv.pool
    assert decode.num_free_blocks == 30  # pins and installs all released
    decode.check_invariants()
