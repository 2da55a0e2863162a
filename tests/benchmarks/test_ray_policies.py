"""The simulator's ports of Ray Serve's PrefixCacheAffinityRouter and KVAwareRouter: each decision
rule on small hand-built cases whose answers follow from Ray's (and Dynamo's) source, then both
ports driving the real simulated cluster."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import simulate
from benchmarks.sim.cluster import Cluster, ClusterConfig
from benchmarks.sim.metrics import summarize_run
from benchmarks.sim.ray_policies import (
    KVAwareConfig,
    KVSignals,
    PrefixAffinityConfig,
    PrefixBlockTree,
    RayKVAwarePolicy,
    RayPrefixAffinityPolicy,
    softmax_pick,
)
from benchmarks.sim.replica import SimRequest
from benchmarks.sim.trace import load_trace
from tests.benchmarks.test_simulate import BLOCK, PROFILE, _record, _write_trace

IDS = ["a", "b", "c"]


def _affinity(seed: int = 0, **options: object) -> RayPrefixAffinityPolicy:
    policy = RayPrefixAffinityPolicy(
        PrefixAffinityConfig(block_tokens=BLOCK, **options),  # type: ignore[arg-type]
        rng=random.Random(seed),
    )
    policy.update_replicas(IDS)
    return policy


def _first(ranks: list[list[str]]) -> str:
    return ranks[0][0]


# -- PrefixCacheAffinityRouter ----------------------------------------------------------------


def test_empty_tree_sends_to_the_smallest_tenant_with_the_shortest_queue() -> None:
    policy = _affinity()
    for rid, load in zip(IDS, (3, 1, 2), strict=True):
        policy.observe_load(rid, load, 0.0)
    ranks = policy.rank_prompt(IDS, [1, 2, 3], 3 * BLOCK, 0.0)
    # Every tenant holds 0 characters: all are "smallest"; the shortest queue wins.
    assert ranks == [["b"], ["c"], ["a"]]
    assert policy.counters == {"smallest_tenant": 1}


def test_a_match_above_the_threshold_wins_whatever_the_load() -> None:
    policy = _affinity()
    policy.on_request_routed("r0", "a", list(range(10)), 0.0)
    policy.observe_load("a", 50, 0.0)  # Ray's default imbalanced_threshold is infinite
    ranks = policy.rank_prompt(IDS, [*range(10), 77], 11 * BLOCK + 5, 1.0)
    assert _first(ranks) == "a"
    assert policy.counters == {"prefix": 1}


def test_a_match_below_the_rate_goes_to_the_smallest_tenants() -> None:
    policy = _affinity()
    policy.on_request_routed("r0", "a", [1, 2], 0.0)
    policy.on_request_routed("r1", "b", [5], 0.0)
    # 1 block of a 20-block prompt: match rate 0.05 < 0.1. Smallest tenant: c (0 tokens).
    ranks = policy.rank_prompt(IDS, [1, *range(100, 119)], 20 * BLOCK, 1.0)
    assert _first(ranks) == "c"
    # 2 of 20 blocks (0.1) is enough: a holds the deepest matched block.
    ranks = policy.rank_prompt(IDS, [1, 2, *range(200, 218)], 20 * BLOCK, 1.0)
    assert _first(ranks) == "a"
    assert policy.counters == {"smallest_tenant": 1, "prefix": 1}


def test_the_match_rate_counts_the_partial_tail_of_the_prompt() -> None:
    policy = _affinity()
    policy.on_request_routed("r0", "a", [1], 0.0)
    # One full matched block: 16 / 160 tokens = 0.1 matches; 16 / 161 does not.
    assert _first(policy.rank_prompt(IDS, [1, *range(50, 59)], 160, 1.0)) == "a"
    assert _first(policy.rank_prompt(IDS, [1, *range(50, 59)], 161, 1.0)) != "a"


def test_the_deepest_matched_node_decides_and_the_shortest_queue_breaks_ties() -> None:
    policy = _affinity()
    policy.on_request_routed("r0", "a", list(range(10)), 0.0)
    policy.on_request_routed("r1", "b", list(range(5)), 0.0)
    policy.observe_load("a", 4, 0.0)
    policy.observe_load("b", 1, 0.0)
    # Blocks 0..9 are only on a: a, although b's queue is shorter.
    assert _first(policy.rank_prompt(IDS, [*range(10), 99], 11 * BLOCK, 1.0)) == "a"
    # Blocks 0..4 then a new one: the deepest node (block 4) is on both; b's queue is shorter.
    assert policy.rank_prompt(IDS, [*range(5), 42], 6 * BLOCK, 1.0)[:2] == [["b"], ["a"]]


def test_imbalance_falls_back_to_power_of_two() -> None:
    policy = _affinity(imbalanced_threshold=2)
    policy.on_request_routed("r0", "a", list(range(10)), 0.0)
    policy.observe_load("a", 5, 0.0)
    policy.observe_load("b", 0, 0.0)
    policy.observe_load("c", 0, 0.0)
    ranks = policy.rank_prompt(IDS, list(range(10)), 10 * BLOCK, 1.0)
    # 5 - 0 > 2: the full match on a is ignored; of two random replicas the less loaded leads.
    assert policy.counters == {"imbalanced": 1}
    assert _first(ranks) in {"b", "c"}


def test_tenant_sizes_count_each_block_once_per_tenant() -> None:
    tree = PrefixBlockTree(BLOCK)
    tree.add_tenants(["a", "b"])
    tree.insert([1, 2, 3], "a", 0.0)
    tree.insert([1, 2, 4], "a", 1.0)
    tree.insert([1, 2], "b", 1.0)
    tree.insert([9], "ghost", 1.0)  # Ray ignores tenants it was not told about
    assert tree.size == {"a": 4 * BLOCK, "b": 2 * BLOCK}
    assert tree.smallest_tenants() == ["b"]
    assert tree.match([1, 2, 3, 7], ["a", "b"]) == (3, ["a"])
    assert tree.match([1, 2, 7], ["a", "b"]) == (2, ["a", "b"])
    assert tree.match([8], ["a", "b"]) == (0, ["a", "b"])
    assert tree.match([1], ["c"]) == (0, [])


def test_lru_eviction_drops_whole_timestamp_groups_oldest_first() -> None:
    tree = PrefixBlockTree(BLOCK)
    tree.add_tenants(["a"])
    tree.insert([1, 2, 3], "a", 0.0)
    tree.insert([1, 5], "a", 1.0)  # touches block 1 again: it is no longer in the oldest group
    # Asked for one token, it drops the whole oldest group: blocks 2 and 3 (time 0).
    assert tree.evict_lru("a", 1) == 2 * BLOCK
    assert tree.size["a"] == 2 * BLOCK
    assert tree.match([1, 2, 3], ["a"]) == (1, ["a"])
    assert tree.match([1, 5], ["a"]) == (2, ["a"])


def test_the_eviction_loop_brings_tenants_down_to_the_target() -> None:
    # 4 characters per token: threshold 10 blocks (640 chars), target 4 blocks (256 chars).
    policy = _affinity(
        do_eviction=True, eviction_threshold_chars=640, eviction_target_chars=256,
        eviction_interval_s=10.0,
    )  # fmt: skip
    for t in range(12):  # 12 one-block prompts on a, one per second
        policy.on_request_routed(f"r{t}", "a", [1000 + t], float(t))
    policy.rank_prompt(IDS, [5], BLOCK, 5.0)  # starts the loop: first pass at t = 15
    assert policy.tree.size["a"] == 12 * BLOCK
    policy.rank_prompt(IDS, [5], BLOCK, 15.0)
    # 768 chars > 640: evict at least 768 - 256 chars = 8 blocks, the oldest first.
    assert policy.tree.size["a"] == 4 * BLOCK
    assert policy.tree.match([1007], IDS)[0] == 0
    assert policy.tree.match([1008], IDS) == (1, ["a"])


# -- KVAwareRouter / Dynamo's cost --------------------------------------------------------------


def _kv(signals: dict[str, KVSignals], seed: int = 0, **options: object) -> RayKVAwarePolicy:
    policy = RayKVAwarePolicy(
        KVAwareConfig(block_tokens=BLOCK, **options),  # type: ignore[arg-type]
        rng=random.Random(seed),
    )
    policy.update_replicas(list(signals))
    policy.bind_signals(lambda rid, hashes: signals[rid])
    return policy


# A: holds 8 of the request's 10 blocks but is busy decoding; B: cold but lightly loaded.
HOT_BUSY = KVSignals(
    overlap_blocks=8, active_blocks=100, shared_active_blocks=8, active_prefill_tokens=0
)
COLD_IDLE = KVSignals(
    overlap_blocks=0, active_blocks=20, shared_active_blocks=0, active_prefill_tokens=320
)


def test_dynamo_cost_by_hand() -> None:
    policy = _kv({"A": HOT_BUSY, "B": COLD_IDLE})
    hashes, prompt = list(range(10)), 10 * BLOCK
    # A: prefill max(0, (0 + 160) / 16 - 8) = 2; decode 100 + (10 - 8) = 102 -> 104.
    # B: prefill (320 + 160) / 16 - 0 = 30; decode 20 + 10 = 30 -> 60.
    assert policy.costs(["A", "B"], hashes, prompt) == [104.0, 60.0]
    assert _first(policy.rank_prompt(["A", "B"], hashes, prompt, 0.0)) == "B"
    # prefill_load_scale 4 weighs uncached prefill against decode blocks: A = 8 + 102, B = 120 + 30.
    heavy = _kv({"A": HOT_BUSY, "B": COLD_IDLE}, prefill_load_scale=4.0)
    assert heavy.costs(["A", "B"], hashes, prompt) == [110.0, 150.0]
    assert heavy.rank_prompt(["A", "B"], hashes, prompt, 0.0) == [["A"], ["B"]]


def test_overlap_credit_is_clamped_at_zero() -> None:
    # An overlap larger than the queued prefill cannot make the prefill term negative.
    s = KVSignals(
        overlap_blocks=10, active_blocks=0, shared_active_blocks=0, active_prefill_tokens=0
    )
    policy = _kv({"A": s}, overlap_score_credit=3.0)
    assert policy.costs(["A"], list(range(10)), 10 * BLOCK) == [10.0]  # 0 prefill + 10 new blocks


def test_argmin_ties_are_broken_at_random() -> None:
    same = KVSignals(
        overlap_blocks=0, active_blocks=5, shared_active_blocks=0, active_prefill_tokens=0
    )
    firsts = {
        _first(_kv({"A": same, "B": same}, seed=s).rank_prompt(["A", "B"], [1], BLOCK, 0.0))
        for s in range(20)
    }
    assert firsts == {"A", "B"}


def test_softmax_sampling_follows_dynamo_normalisation() -> None:
    # Costs normalised by their range: p ~ exp(-(c - min) / ((max - min) * T)).
    p0 = 1.0 / (1.0 + math.exp(-1.0))  # costs (0, 10), T = 1
    assert softmax_pick([0.0, 10.0], 1.0, p0 - 1e-9) == 0
    assert softmax_pick([0.0, 10.0], 1.0, p0 + 1e-9) == 1
    # The scale of the costs does not matter, only their spread relative to the range.
    assert softmax_pick([100.0, 1100.0], 1.0, p0 - 1e-9) == 0
    # All equal: uniform.
    assert [softmax_pick([3.0] * 4, 0.5, s) for s in (0.2, 0.45, 0.7, 0.99)] == [0, 1, 2, 3]
    # Drawn through the policy, the frequencies match the probabilities.
    policy = _kv({"A": HOT_BUSY, "B": COLD_IDLE}, router_temperature=1.0)
    counts = Counter(
        _first(policy.rank_prompt(["A", "B"], list(range(10)), 10 * BLOCK, 0.0))
        for _ in range(4000)
    )
    assert counts["B"] / 4000 == pytest.approx(p0, abs=0.03)  # B is the cheaper one


def test_kv_aware_needs_its_signals() -> None:
    policy = RayKVAwarePolicy(KVAwareConfig(block_tokens=BLOCK))
    with pytest.raises(RuntimeError, match="bind_signals"):
        policy.rank_prompt(["A"], [1], BLOCK, 0.0)


# -- in the simulated cluster ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["ray_prefix_affinity", "ray_kv_aware"])
def test_ports_keep_a_shared_prefix_together(tmp_path: Path, policy: str) -> None:
    n = 20
    records = [_record(1000 * i, [*range(10), 100 + i]) for i in range(n)]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    config = ClusterConfig(replicas=4, capacity_blocks=1000, policy=policy, block_tokens=BLOCK)
    run = Cluster(PROFILE, config).run(specs)
    prompt = specs[0].prompt_len
    # Every request after the first hits the 10 shared blocks, as with our prefix-aware policy.
    assert summarize_run(run)["hit_ratio"] == pytest.approx((n - 1) * 10 * BLOCK / (n * prompt))
    assert len({r.replica for r in run.requests}) == 1


def test_kv_signals_read_the_replica_engine_state(tmp_path: Path) -> None:
    records = [_record(0, [*range(6), 50], out=2000)]  # a long output keeps it running
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    cluster = Cluster(PROFILE, ClusterConfig(replicas=1, capacity_blocks=100, block_tokens=BLOCK))
    replica = cluster.replicas[0]
    hashes = specs[0].block_hashes
    request = SimRequest(specs[0], BLOCK)
    replica.add(request)
    queued = replica.kv_signals(hashes)
    # Waiting: its blocks are booked, its whole prompt is still to prefill, nothing cached yet.
    assert queued == KVSignals(0, -(-specs[0].prompt_len // BLOCK), 0, specs[0].prompt_len)
    duration = replica.start_step()
    assert duration is not None
    replica.finish_step(duration)
    running = replica.kv_signals(hashes)
    assert running.overlap_blocks == running.shared_active_blocks == 6
    assert running.active_prefill_tokens == 0
    assert running.active_blocks == replica.kv.pool.num_blocks - replica.kv.pool.num_free_blocks


def test_the_command_line_runs_the_ports(tmp_path: Path) -> None:
    records = [_record(500 * i, [i % 3, 10 + i]) for i in range(30)]
    trace = _write_trace(tmp_path / "t.jsonl", records)
    common = ["--trace", str(trace), "--replicas", "3", "--quiet", "--block-tokens", str(BLOCK),
              "--capacity-blocks", "200"]  # fmt: skip
    doc = simulate.main([*common, "--policy", "ray_prefix_affinity,ray_kv_aware,power_of_two"])
    assert [r["policy"] for r in doc["runs"]] == [
        "ray_prefix_affinity",
        "ray_kv_aware",
        "power_of_two",
    ]
    assert all(r["completed"] == 30 for r in doc["runs"])
    tuned = simulate.main(
        [*common, "--policy", "ray_kv_aware", "--router-config", '{"router_temperature": 0.5}']
    )
    assert tuned["runs"][0]["completed"] == 30
    with pytest.raises(ValueError, match="router_temperature"):
        simulate.main(
            [*common, "--policy", "ray_prefix_affinity",
             "--router-config", '{"router_temperature": 0.5}']
        )  # fmt: skip
