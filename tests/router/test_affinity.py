"""Session affinity and hot-prefix replication in the prefix-aware policy, and the bounded tables
behind them."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from router import PrefixAwarePolicy, RouterConfig, make_policy
from router.affinity import (
    PrefixHeat,
    RecentSessions,
    SessionTable,
    prefix_home,
    session_home,
)
from tests.router.support import prompt_hashes, random_tokens, report


def prefix_policy(seed: int = 0, **options: object) -> PrefixAwarePolicy:
    # Without evict_oldest and the holder margin unless a test asks: these tests pin down the
    # prefix home, power of two choices and the plain cost ranking.
    options = {"evict_oldest": False, "holder_margin_per_block": 0.0, **options}
    policy = make_policy("prefix_aware", RouterConfig(**options), rng=random.Random(seed))
    assert isinstance(policy, PrefixAwarePolicy)
    return policy


def first(ranks: list[list[str]]) -> str:
    return ranks[0][0]


# -- the tables ------------------------------------------------------------------------------


def test_session_table_forgets_the_least_recently_routed_session() -> None:
    table = SessionTable(capacity=2)
    table.record("s1", "a", 3)
    table.record("s2", "b", 4)
    table.record("s1", "c", 5)  # s1 routed again: now the most recent
    table.record("s3", "a", 1)
    assert table.get("s2") is None
    assert table.get("s1") is not None and table.get("s1").replica_id == "c"  # type: ignore[union-attr]
    assert len(table) == 2
    off = SessionTable(capacity=0)
    off.record("s1", "a", 3)
    assert off.get("s1") is None


def test_prefix_heat_reads_a_steady_rate_in_requests_per_second() -> None:
    heat = PrefixHeat(capacity=8, window_s=10.0)
    now = 0.0
    for _ in range(600):  # 5 requests per second for two minutes
        heat.touch(7, now)
        now += 0.2
    # An exponentially weighted count: between a touch and the next one the estimate decays
    # from about rate + 1/(2 * window) to rate - 1/(2 * window).
    assert heat.rate(7, now - 0.1) == pytest.approx(5.0, abs=0.06)
    # A minute of silence: e^-6 of it is left.
    assert heat.rate(7, now + 60) == pytest.approx(heat.rate(7, now) * math.exp(-6), rel=1e-9)
    assert heat.rate(8, now) == 0.0


def test_prefix_heat_is_bounded() -> None:
    heat = PrefixHeat(capacity=3, window_s=1.0)
    for key in range(10):
        heat.touch(key, float(key))
    assert len(heat) == 3
    assert heat.rate(0, 10.0) == 0.0 and heat.rate(9, 9.0) > 0


# -- session affinity ------------------------------------------------------------------------


def test_a_session_returns_to_its_replica_even_without_a_shared_prefix() -> None:
    # Turn 2 of each session shares no block with turn 1 (its template changed the first tokens),
    # so only the session can keep it; without one the request goes by load alone.
    rng = random.Random(5)
    replicas = ["a", "b", "c", "d"]
    for seed in range(10):
        policy = prefix_policy(seed=seed)
        for replica in replicas:
            policy.apply_report(replica, report(replica, [], at=0.5), now=0.5)
        homes = {}
        for s in range(8):
            turn1 = prompt_hashes(random_tokens(rng, 64))
            now = 1.0 + s
            home = first(policy.rank(replicas, turn1, now, session=f"s{s}"))
            policy.on_request_routed(f"s{s}-1", home, turn1, now, session=f"s{s}")
            policy.on_request_completed(f"s{s}-1", now + 0.2)
            homes[s] = home
        for s in range(8):
            turn2 = prompt_hashes(random_tokens(rng, 64))
            assert first(policy.rank(replicas, turn2, 20.0 + s, session=f"s{s}")) == homes[s]
        assert policy.counters["session"] == 8


def test_routers_that_share_no_memory_send_a_sessions_turns_to_one_replica() -> None:
    # Serve runs a router per proxy node and HAProxy round-robins over them: turn 2 of a session
    # often reaches a router that never saw turn 1. Turn 2 shares no block with turn 1.
    rng = random.Random(7)
    replicas = ["a", "b", "c", "d"]
    routers = [prefix_policy(seed=1), prefix_policy(seed=2)]
    for router in routers:
        for replica in replicas:
            router.apply_report(replica, report(replica, [], at=0.5), now=0.5)
    homes = []
    for s in range(24):
        turn1, turn2 = (prompt_hashes(random_tokens(rng, 64)) for _ in range(2))
        went = first(routers[0].rank(replicas, turn1, 1.0 + s, session=f"s{s}"))
        routers[0].on_request_routed(f"s{s}-1", went, turn1, 1.0 + s, session=f"s{s}")
        routers[0].on_request_completed(f"s{s}-1", 1.5 + s)
        assert first(routers[1].rank(replicas, turn2, 2.0 + s, session=f"s{s}")) == went
        # The home is the replica set's, not the order the candidates came in.
        assert session_home(f"s{s}", replicas[::-1]) == went
        homes.append(went)
    assert len(set(homes)) == len(replicas)  # sessions spread over the replicas
    assert routers[0].counters["session_home"] == routers[1].counters["session_home"] == 24


def test_routers_that_share_no_memory_meet_on_a_new_prefix() -> None:
    # A system prompt no replica reports yet, sent through two routers alternately: both send it
    # to its first block's home while that replica is at most one such request behind.
    rng = random.Random(9)
    replicas = ["a", "b", "c"]
    routers = [prefix_policy(seed=3), prefix_policy(seed=4)]
    for router in routers:
        for replica in replicas:
            router.apply_report(replica, report(replica, [], at=0.5), now=0.5)
    for g in range(12):
        system = random_tokens(rng, 96)
        prompts = [prompt_hashes(system + random_tokens(rng, 16)) for _ in range(4)]
        went = {first(routers[i % 2].rank(replicas, p, 1.0 + g)) for i, p in enumerate(prompts)}
        assert went == {prefix_home(prompts[0][0], replicas)}
    # A home far more loaded than the others is passed over.
    router = routers[0]
    hashes = prompt_hashes(random_tokens(rng, 96))
    home = prefix_home(hashes[0], replicas)
    router.apply_report(home, report(home, [], at=30.0, running=6, pending_prefill_tokens=900), 30)
    assert first(router.rank(replicas, hashes, 30.0)) != home
    assert router.counters["fallback"] == 1


def test_a_router_learns_from_reports_where_another_router_sent_a_session() -> None:
    # Router 0 sent the session to the replica that is not its home (load); the replica's report
    # tells router 1, which then sends turn 2 there with the previous prompt priced as cached.
    rng = random.Random(11)
    replicas = ["a", "b"]
    other = next(r for r in replicas if r != session_home("chat-1", replicas))
    turn2 = prompt_hashes(random_tokens(rng, 80))
    router = prefix_policy(seed=5)
    served = RecentSessions(capacity=8, window_s=60.0)
    served.touch("chat-1", 4, now=1.0)
    for replica in replicas:
        sessions = served.snapshot(2.0) if replica == other else []
        stats = {**report(replica, [], at=2.0), "recent_sessions": sessions}
        router.apply_report(replica, stats, now=2.0)
    assert first(router.rank(replicas, turn2, 3.0, session="chat-1")) == other
    scores = {s.replica_id: s for s in router.score(replicas, turn2, 3.0, session="chat-1")}
    assert scores[other].session and scores[other].matched_blocks == 4
    # A session this router routed itself is not overridden by a report.
    router.on_request_routed("t3", "a", turn2, 4.0, session="chat-2")
    stats = {**report("b", [], at=5.0), "recent_sessions": [("chat-2", 9)]}
    router.apply_report("b", stats, now=5.0)
    assert first(router.rank(replicas, turn2, 6.0, session="chat-2")) == "a"


def test_recent_sessions_age_out_of_the_report() -> None:
    served = RecentSessions(capacity=2, window_s=10.0)
    served.touch("s1", 1, now=0.0)
    served.touch("s2", 2, now=5.0)
    served.touch("s1", 3, now=6.0)
    assert served.snapshot(12.0) == [("s2", 2), ("s1", 3)]
    assert served.snapshot(15.5) == [("s1", 3)]
    served.touch("s3", 0, now=16.0)  # over capacity: s2, least recently served, goes
    assert served.snapshot(16.0) == [("s1", 3), ("s3", 0)]


@pytest.mark.parametrize("bad", ["s1", [["s1"]], [["s1", -1]], [[1, 2]], [["s1", True]], {"s1": 2}])
def test_a_malformed_session_list_is_refused_by_name(bad: object) -> None:
    router = prefix_policy()
    with pytest.raises(ValueError, match="recent_sessions"):
        router.apply_report("a", {**report("a", [], at=1.0), "recent_sessions": bad}, now=1.0)


def test_a_new_replica_takes_only_the_sessions_whose_home_it_becomes() -> None:
    sessions = [f"user-{i}" for i in range(400)]
    before = {s: session_home(s, ["a", "b", "c"]) for s in sessions}
    after = {s: session_home(s, ["a", "b", "c", "d"]) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "d" for s in moved)
    assert 60 < len(moved) < 140  # about a quarter
    assert session_home("user-1", []) is None


def test_a_session_leaves_its_replica_when_the_cost_says_so() -> None:
    policy = prefix_policy()
    turn1 = list(range(100, 104))
    policy.apply_report("a", report("a", [], at=0.5), now=0.5)
    policy.apply_report("b", report("b", [], at=0.5), now=0.5)
    policy.on_request_routed("t1", "a", turn1, 1.0, session="s")
    policy.on_request_completed("t1", 1.5)
    turn2 = list(range(200, 204))
    assert first(policy.rank(["a", "b"], turn2, 2.0, session="s")) == "a"
    # "a" is now prefilling a long prompt: 4 blocks of reuse do not pay for waiting behind 200.
    policy.apply_report("a", report("a", [], at=2.5, running=1, pending_prefill_tokens=3200), 2.5)
    assert first(policy.rank(["a", "b"], turn2, 3.0, session="s")) == "b"


def test_the_session_credit_is_the_previous_prompt() -> None:
    policy = prefix_policy()
    policy.apply_report("a", report("a", [], at=0.5), now=0.5)
    policy.apply_report("b", report("b", [], at=0.5), now=0.5)
    policy.on_request_routed("t1", "a", [1, 2, 3], 1.0, session="s")
    policy.on_request_completed("t1", 1.1)
    scores = {s.replica_id: s for s in policy.score(["a", "b"], [9, 8, 7, 6, 5], 40.0, session="s")}
    assert scores["a"].session and scores["a"].matched_blocks == 3
    assert scores["a"].uncached_blocks == 2
    assert not scores["b"].session and scores["b"].matched_blocks == 0


# -- hot prefixes ----------------------------------------------------------------------------


def _tenant_stream(
    policy: PrefixAwarePolicy, replicas: list[str], system: list[int], rate: float, count: int
) -> list[str]:
    """``count`` requests sharing ``system`` (then a unique question block each), ``rate`` per
    second; none completes, so the holder's queue only grows."""
    destinations = []
    for i in range(count):
        now = 1.0 + i / rate
        hashes = [*system, 10_000 + i]
        replica = first(policy.rank(replicas, hashes, now))
        policy.on_request_routed(f"q{i}", replica, hashes, now)
        destinations.append(replica)
    return destinations


def test_a_hot_prefix_is_replicated_to_a_second_replica() -> None:
    system = list(range(500, 532))  # a 32-block system prompt, cached on "a"
    replicas = ["a", "b", "c", "d"]
    # The guard out of the way: the cost model alone must decide.
    policy = prefix_policy(imbalance_abs=1000, load_cost_per_request=1.0)
    for replica in replicas:
        held = system if replica == "a" else []
        policy.apply_report(replica, report(replica, held, at=0.5), now=0.5)
    destinations = _tenant_stream(policy, replicas, system, rate=4.0, count=40)
    counts = Counter(destinations)
    # The holder takes the prefix's requests until the prefix is hot (1 request per second over
    # the 10 s window from the 12th request on; by then 11 queued requests on "a" cost more
    # than a copy elsewhere: 8 units). The 12th goes to a second replica.
    assert destinations[:11] == ["a"] * 11
    assert destinations[11] != "a"
    # Then it is served from exactly two replicas: the holder and the one it was copied to.
    assert len(counts) == 2
    second = next(r for r in counts if r != "a")
    assert counts[second] >= 12
    assert policy.counters["replicate"] == 1  # one request paid for the copy; then both hold it
    assert policy.view(second).matched_blocks(system, 30.0, 30.0) == len(system)  # type: ignore[union-attr]


def test_a_prefix_asked_for_rarely_is_not_replicated() -> None:
    system = list(range(500, 532))
    replicas = ["a", "b", "c", "d"]
    policy = prefix_policy(imbalance_abs=1000, load_cost_per_request=1.0)
    for replica in replicas:
        held = system if replica == "a" else []
        policy.apply_report(replica, report(replica, held, at=0.5), now=0.5)
    # Half a request per second: the holder keeps every one (its queue grows to 20 requests,
    # still cheaper than 32 blocks of prefill elsewhere).
    destinations = _tenant_stream(policy, replicas, system, rate=0.5, count=20)
    assert set(destinations) == {"a"}
    assert "replicate" not in policy.counters
    # The same stream with replication off stays on "a" even when it is hot.
    policy = prefix_policy(imbalance_abs=1000, load_cost_per_request=1.0, hot_prefix_rate=0.0)
    for replica in replicas:
        held = system if replica == "a" else []
        policy.apply_report(replica, report(replica, held, at=0.5), now=0.5)
    assert set(_tenant_stream(policy, replicas, system, rate=4.0, count=20)) == {"a"}


def test_an_idle_holder_keeps_its_hot_prefix() -> None:
    # Hot, but every request completes before the next: nothing to gain from a second copy.
    system = list(range(500, 532))
    policy = prefix_policy()
    policy.apply_report("a", report("a", system, at=0.5), now=0.5)
    policy.apply_report("b", report("b", [], at=0.5), now=0.5)
    for i in range(100):
        now = 1.0 + i / 5
        hashes = [*system, 10_000 + i]
        assert first(policy.rank(["a", "b"], hashes, now)) == "a"
        policy.on_request_routed(f"q{i}", "a", hashes, now)
        policy.on_request_completed(f"q{i}", now + 0.1)
    assert policy.heat.rate(system[-1], 21.0) > 4.0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("session_capacity", -1),
        ("hot_prefix_rate", -1.0),
        ("hot_prefix_window_s", 0.0),
        ("hot_prefix_cost_per_block", float("nan")),
        ("hot_prefix_max_replicas", 1.5),
    ],
)
def test_bad_affinity_options_are_refused_by_name(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        RouterConfig(**{option: value})
