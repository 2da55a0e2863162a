"""The per-replica view: reports, eviction, own decisions, restarts, removals, load accounting."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import ClusterState, ReplicaReport, RouterConfig, make_policy
from tests.router.support import report

H = list(range(500, 520))
TTL = 30.0


def state() -> ClusterState:
    return ClusterState(decision_ttl_s=TTL)


def test_eviction_report_removes_a_hash_from_the_view() -> None:
    s = state()
    s.apply_report("a", report("a", H[:8], at=1.0), now=1.0)
    assert s.views["a"].matched_blocks(H, 1.0, TTL) == 8
    # The replica evicted blocks 4..7: a full snapshot without them.
    assert s.apply_report("a", report("a", H[:4], at=2.0), now=2.0)
    assert s.views["a"].matched_blocks(H, 2.0, TTL) == 4
    assert not s.views["a"].holds(H[5], 2.0, TTL)


def test_eviction_flips_the_routing_decision() -> None:
    policy = make_policy("prefix_aware", rng=random.Random(0))
    policy.apply_report("a", report("a", H, at=1.0), now=1.0)
    policy.apply_report("b", report("b", H[:5], at=1.0), now=1.0)
    assert policy.rank(["a", "b"], H, now=1.0)[0] == ["a"]
    policy.apply_report("a", report("a", [], at=2.0), now=2.0)
    assert policy.rank(["a", "b"], H, now=2.0)[0] == ["b"]


def test_older_or_repeated_reports_are_ignored() -> None:
    s = state()
    assert s.apply_report("a", report("a", H[:8], at=5.0, running=3), now=5.0)
    assert not s.apply_report("a", report("a", H[:8], at=5.0, running=3), now=6.0)
    assert not s.apply_report("a", report("a", [], at=4.0, running=9), now=6.0)
    assert s.views["a"].matched_blocks(H, 6.0, TTL) == 8
    assert s.views["a"].estimated_load == 3


def test_own_decision_is_visible_before_any_report() -> None:
    policy = make_policy("prefix_aware", rng=random.Random(0))
    policy.on_request_routed("q1", "b", H, now=1.0)
    assert policy.view("b").matched_blocks(H, 1.1, TTL) == len(H)  # type: ignore[union-attr]
    # Nothing reported anywhere, yet the next request with this prefix follows the first.
    assert policy.rank(["a", "b", "c"], H[:12], now=1.1)[0] == ["b"]


def test_own_decision_survives_reports_while_its_request_is_in_flight() -> None:
    s = state()
    s.on_request_routed("q1", "a", H, now=1.0)
    # A report taken after the decision but before the replica prefilled the request.
    s.apply_report("a", report("a", [], at=2.0, waiting=1), now=2.0)
    assert s.views["a"].matched_blocks(H, 2.0, TTL) == len(H)
    s.on_request_completed("q1", now=3.0)
    # Completed, and no newer report yet: still counted (within the TTL).
    assert s.views["a"].matched_blocks(H, 3.5, TTL) == len(H)
    # A report newer than the completion is authoritative: the replica holds only 5 blocks.
    s.apply_report("a", report("a", H[:5], at=4.0), now=4.0)
    assert s.views["a"].matched_blocks(H, 4.0, TTL) == 5
    assert s.views["a"].own == {}


def test_own_decision_expires_after_the_ttl_without_reports() -> None:
    s = state()
    s.on_request_routed("q1", "a", H, now=1.0)
    s.on_request_completed("q1", now=2.0)
    assert s.views["a"].holds(H[0], 2.0 + TTL - 0.1, TTL)
    assert not s.views["a"].holds(H[0], 2.0 + TTL, TTL)
    # Expired entries are swept as new decisions arrive, so memory stays bounded.
    s.on_request_routed("q2", "a", [7, 8], now=2.0 + TTL + 1)
    assert set(s.views["a"].own) == {7, 8}


def test_report_older_than_the_decision_keeps_it() -> None:
    s = state()
    s.on_request_routed("q1", "a", H, now=5.0)
    s.on_request_completed("q1", now=6.0)
    s.apply_report("a", report("a", [], at=5.5), now=6.5)  # snapshot predates the completion
    assert s.views["a"].matched_blocks(H, 6.5, TTL) == len(H)


def test_restart_forgets_the_cache_and_own_decisions() -> None:
    s = state()
    s.apply_report("a", report("a", H, at=1.0, started_at=100.0), now=1.0)
    s.on_request_routed("q1", "a", [1, 2, 3], now=2.0)
    s.apply_report("a", report("a", [], at=3.0, started_at=200.0), now=3.0)
    view = s.views["a"]
    assert view.started_at == 200.0
    assert view.matched_blocks(H, 3.0, TTL) == 0
    assert view.matched_blocks([1, 2, 3], 3.0, TTL) == 0
    assert view.num_in_flight == 0
    assert s.in_flight("q1") is None
    assert not s.on_request_completed("q1", now=4.0)
    # A late report from before the restart must not resurrect the old cache.
    assert not s.apply_report("a", report("a", H, at=3.5, started_at=100.0), now=4.0)
    assert s.views["a"].matched_blocks(H, 4.0, TTL) == 0


def test_removed_replica_is_forgotten_with_its_requests() -> None:
    policy = make_policy("prefix_aware", rng=random.Random(0))
    policy.apply_report("a", report("a", H, at=1.0), now=1.0)
    policy.on_request_routed("q1", "a", H, now=1.5)
    policy.update_replicas(["b", "c"])
    assert policy.view("a") is None
    assert policy.state.in_flight("q1") is None
    policy.on_request_completed("q1", now=2.0)  # late completion: ignored
    ranks = policy.rank(["b", "c"], H, now=2.0)
    assert sorted(r[0] for r in ranks) == ["b", "c"]
    # Re-added under the same id: starts empty, no stale cache.
    policy.update_replicas(["a", "b", "c"])
    assert policy.view("a").matched_blocks(H, 2.0, TTL) == 0  # type: ignore[union-attr]
    policy.remove_replica("b")
    assert policy.view("b") is None


def test_load_estimate_combines_report_and_own_requests() -> None:
    s = state()
    s.on_request_routed("old", "a", [], now=1.0)
    s.apply_report("a", report("a", [], at=2.0, running=4, waiting=1), now=2.0)
    view = s.views["a"]
    assert view.estimated_load == 5  # "old" is among the 5 reported
    s.on_request_routed("new1", "a", [], now=3.0)
    s.on_request_routed("new2", "a", [], now=3.0)
    assert view.estimated_load == 7
    s.on_request_completed("new1", now=4.0)
    s.on_request_completed("old", now=4.0)
    assert view.estimated_load == 5
    # A fresher figure (e.g. Serve's queue length) replaces the report's.
    s.observe_load("a", 2, now=5.0)
    assert view.estimated_load == 2
    s.on_request_completed("new2", now=6.0)
    assert view.estimated_load == 1
    # A report older than the observation leaves the load alone but still updates the cache.
    s.apply_report("a", report("a", [9], at=4.5, running=50), now=6.0)
    assert view.estimated_load == 1
    assert view.holds(9, 6.0, TTL)


def test_load_estimate_never_below_own_in_flight() -> None:
    s = state()
    for i in range(3):
        s.on_request_routed(f"q{i}", "a", [], now=1.0)
    s.apply_report("a", report("a", [], at=2.0), now=2.0)  # the requests had not arrived yet
    assert s.views["a"].estimated_load == 3


def test_queued_prefill_reported_plus_own_requests_routed_since() -> None:
    s = state()
    s.apply_report("a", report("a", H[:4], at=1.0, pending_prefill_tokens=33), now=1.0)
    view = s.views["a"]
    assert view.estimated_prefill_blocks == 3  # 33 tokens in blocks of 16, rounded up
    s.on_request_routed("q1", "a", H[:10], now=2.0)  # 4 of its 10 blocks are cached there
    assert view.inflight_prefill["q1"] == 6
    assert view.estimated_prefill_blocks == 3 + 6
    s.on_request_routed("q2", "a", H[:2], now=2.5)  # fully cached: no prefill expected
    assert view.estimated_prefill_blocks == 9
    # A report taken after both were routed includes them: its figure replaces the guesses.
    s.apply_report("a", report("a", H[:10], at=3.0, pending_prefill_tokens=16), now=3.0)
    assert view.estimated_prefill_blocks == 1
    s.on_request_routed("q3", "a", H[:12], now=4.0)  # 2 new blocks (own decisions hold 0..9)
    assert view.estimated_prefill_blocks == 3
    s.on_request_completed("q3", now=4.5)  # routed after the report: its guess goes
    assert view.estimated_prefill_blocks == 1
    # Routed before: the report's block can only have been its own (q2 expected none, and no
    # foreign request was seen), and a completed request has finished its prefill.
    s.on_request_completed("q1", now=4.5)
    assert view.estimated_prefill_blocks == 0


def test_completed_request_takes_its_prefill_out_of_the_reported_queue() -> None:
    s = state()
    s.on_request_routed("long", "a", H[:20], now=1.0)  # 20 blocks to prefill
    s.on_request_routed("other", "a", H[:1], now=1.0)  # fully covered by "long" below
    view = s.views["a"]
    # The report, taken while "long" was still prefilling, counts its 20 blocks.
    s.apply_report("a", report("a", [], at=1.5, running=2, pending_prefill_tokens=320), now=1.5)
    assert view.estimated_prefill_blocks == 20
    # "long" completes before the next report: its prefill is over, nothing is queued any more.
    s.on_request_completed("long", now=1.8)
    assert view.estimated_prefill_blocks == 0


def test_prefill_of_other_routers_requests_stays_until_the_next_report() -> None:
    s = state()
    s.on_request_routed("mine", "a", H[:4], now=1.0)  # 4 blocks to prefill
    view = s.views["a"]
    # The report counts 30 queued blocks: at most 4 of them this router's request's, so at
    # least 26 belong to requests other routers sent.
    s.apply_report("a", report("a", [], at=1.5, running=2, pending_prefill_tokens=480), now=1.5)
    assert view.estimated_prefill_blocks == 30
    s.on_request_completed("mine", now=1.8)
    assert view.estimated_prefill_blocks == 26
    s.apply_report("a", report("a", [], at=2.0, running=1, pending_prefill_tokens=0), now=2.0)
    assert view.estimated_prefill_blocks == 0


def test_report_validation() -> None:
    good = report("a", [1, 2], at=1.0)
    assert ReplicaReport.from_dict(good).cached_block_hashes == frozenset({1, 2})
    assert ReplicaReport.from_dict(good).load == 0
    older = dict(good)
    del older["num_pending_prefill_tokens"]  # optional: replicas of an older build omit it
    assert ReplicaReport.from_dict(older).num_pending_prefill_tokens == 0
    for key in ("num_running", "cached_block_hashes", "reported_at", "started_at"):
        bad = dict(good)
        del bad[key]
        with pytest.raises(ValueError, match=key):
            ReplicaReport.from_dict(bad)
    for key, value in (
        ("num_waiting", -1),
        ("block_size", 1.5),
        ("kv_free_blocks", True),
        ("reported_at", "now"),
        ("reported_at", float("nan")),
        ("cached_block_hashes", "1,2"),
        ("num_pending_prefill_tokens", -5),
        ("num_pending_prefill_tokens", 2.5),
    ):
        with pytest.raises(ValueError, match=key):
            ReplicaReport.from_dict({**good, key: value})
    s = state()
    with pytest.raises(ValueError):
        s.apply_report("a", {**good, "num_running": None}, now=1.0)


def test_config_validation() -> None:
    assert RouterConfig().imbalance_rel == 2.0
    for field, value in (
        ("prefill_cost_per_block", -1.0),
        ("load_cost_per_request", float("inf")),
        ("transfer_cost_per_block", "0.1"),
        ("min_match_blocks", -1),
        ("min_match_blocks", 1.5),
        ("imbalance_abs", True),
        ("imbalance_rel", 0.5),
        ("decision_ttl_s", 0.0),
    ):
        with pytest.raises(ValueError, match=field):
            RouterConfig(**{field: value})
    with pytest.raises(ValueError, match="unknown router option.*imbalance_ab"):
        RouterConfig.from_mapping({"imbalance_ab": 3})
    config = RouterConfig.from_mapping({"prefill_cost_per_block": 2, "stats_period_s": 1.0})
    assert config.prefill_cost_per_block == 2
    assert RouterConfig.from_mapping(config.to_dict()) == config


def test_router_args_and_router_config_agree() -> None:
    from deployments.config import RouterArgs

    args = RouterArgs().model_dump()
    config = RouterConfig.from_mapping(args).to_dict()
    assert set(args) - {"stats_period_s"} == set(config)
    assert all(args[k] == v for k, v in config.items())


# -- accounting invariants under arbitrary interleavings -------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.integers(0, 9), st.sampled_from("ab"), st.integers(0, 4)),
        st.tuples(st.just("complete"), st.integers(0, 9)),
        st.tuples(st.just("report"), st.sampled_from("ab"), st.integers(0, 5), st.integers(0, 4)),
        st.tuples(st.just("observe"), st.sampled_from("ab"), st.integers(0, 8)),
        st.tuples(st.just("restart"), st.sampled_from("ab")),
        st.tuples(st.just("remove"), st.sampled_from("ab")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_accounting_invariants(ops: list[tuple]) -> None:
    s = ClusterState(decision_ttl_s=5.0)
    now = 0.0
    started = {"a": 1.0, "b": 1.0}
    for op in ops:
        now += 0.5
        kind = op[0]
        if kind == "route":
            _, q, replica, n = op
            s.on_request_routed(f"q{q}", replica, H[:n], now)
        elif kind == "complete":
            s.on_request_completed(f"q{op[1]}", now)
        elif kind == "report":
            _, replica, n, load = op
            stats = report(replica, H[:n], at=now - 0.25, running=load, started_at=started[replica])
            s.apply_report(replica, stats, now)
        elif kind == "observe":
            s.observe_load(op[1], op[2], now)
        elif kind == "restart":
            started[op[1]] += 1.0
            s.apply_report(op[1], report(op[1], at=now, started_at=started[op[1]]), now)
        else:
            s.remove_replica(op[1])
        for view in s.views.values():
            assert view.unreported == sum(t > view.load_at for t in view.inflight.values())
            assert view.completed_since >= 0
            assert view.estimated_load >= view.num_in_flight >= 0
            # Pins equal the number of in-flight requests whose prompt covers the block.
            for h, (pins, _stamp) in view.own.items():
                covering = sum(h in s._requests[r].block_hashes for r in view.inflight)
                assert pins == covering
            for request_id in view.inflight:
                assert s.in_flight(request_id) == view.replica_id
            # The prefill of own requests the newest report may include, still in flight.
            counted = sum(
                view.inflight_prefill[r] for r, t in view.inflight.items() if t <= view.report_at
            )
            assert view.reported_own_prefill == counted
            assert view.unreported_prefill <= view.estimated_prefill_blocks
            assert view.estimated_prefill_blocks <= (
                view.reported_prefill_blocks + view.unreported_prefill
            )


def test_eviction_horizon_follows_the_blocks_the_reports_show_written() -> None:
    s = state()
    view = s.view("a")
    assert view.eviction_key() == (False, 0.0)  # nothing reported: nothing written
    # Capacity 10: the first report's 4 blocks count as written at 1.0, then 4 more, then 4 more.
    s.apply_report("a", report("a", range(4), at=1.0, total=10), now=1.0)
    s.apply_report("a", report("a", range(8), at=2.0, total=10), now=2.0)
    assert view.intake_blocks == 8
    assert view.eviction_key() == (False, 8.0)  # not full yet: new blocks evict nothing
    assert view.eviction_horizon() == float("-inf")
    # Blocks 0-1 evicted, 8-11 written: 12 written in all; the oldest of the last 10 (block 2)
    # was written by the report at 1.0.
    s.apply_report("a", report("a", range(2, 12), at=3.0, total=10), now=3.0)
    assert view.intake_blocks == 12
    assert view.eviction_key() == (True, 1.0)
    # The same snapshot again writes nothing; 6 new blocks make block 8 the oldest left, the
    # first of the 4 written between the reports at 2.0 and 3.0: taken as written at 2.25.
    s.apply_report("a", report("a", range(2, 12), at=4.0, total=10), now=4.0)
    s.apply_report("a", report("a", range(8, 18), at=5.0, total=10), now=5.0)
    assert view.intake_blocks == 18
    assert view.eviction_key() == (True, 2.25)
    # 3 more: block 11, the last of those 4, is the oldest left, written by 3.0.
    s.apply_report("a", report("a", range(11, 21), at=6.0, total=10), now=6.0)
    assert view.eviction_key() == (True, 3.0)


def test_eviction_horizon_spreads_a_reports_writes_over_its_period() -> None:
    # Capacity 10. Both replicas write 10 blocks by 1.0 and 10 more between 1.0 and 2.0; then
    # "a" writes 8 more and "b" 2. a's oldest kept block is the 9th of the 10 written between
    # 1.0 and 2.0, b's the 3rd: both reported at 2.0, but b's was written earlier.
    s = state()
    for r, base, more in (("a", 0, 8), ("b", 100, 2)):
        s.apply_report(r, report(r, range(base, base + 10), at=1.0, total=10), now=1.0)
        s.apply_report(r, report(r, range(base + 10, base + 20), at=2.0, total=10), now=2.0)
        s.apply_report(
            r, report(r, range(base + 10 + more, base + 20 + more), at=3.0, total=10), now=3.0
        )
    assert s.view("a").eviction_key() == (True, pytest.approx(1.9))
    assert s.view("b").eviction_key() == (True, pytest.approx(1.3))


def test_a_restarted_replica_counts_its_writes_afresh() -> None:
    s = state()
    s.apply_report("a", report("a", range(20), at=1.0, total=10), now=1.0)
    assert s.view("a").eviction_key() == (True, 1.0)
    s.apply_report("a", report("a", range(3), at=2.0, total=10, started_at=1.5), now=2.0)
    assert s.view("a").eviction_key() == (False, 3.0)
