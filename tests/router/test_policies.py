"""Routing decisions of the policies, driven the way a simulator drives them: explicit clock,
seeded generator, reports as plain dicts."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import PrefixAwarePolicy, RouterConfig, make_policy
from tests.router.support import prompt_hashes, random_tokens, report

H = list(range(1000, 1040))  # 40 chained-looking block hashes of one long prompt
# The load weights the arithmetic in some tests below uses (whatever the defaults are).
WEIGHTS = {"load_cost_per_request": 4.0, "queued_prefill_cost_per_block": 0.5}


def prefix_policy(seed: int = 0, **options: object) -> PrefixAwarePolicy:
    # Without evict_oldest and the holder margin unless a test asks: these tests pin down the
    # prefix home, power of two choices and the plain cost ranking.
    options = {"evict_oldest": False, "holder_margin_per_block": 0.0, **options}
    policy = make_policy("prefix_aware", RouterConfig(**options), rng=random.Random(seed))
    assert isinstance(policy, PrefixAwarePolicy)
    return policy


def first(ranks: list[list[str]]) -> str:
    return ranks[0][0]


def test_ranks_cover_every_candidate_once_best_first() -> None:
    policy = prefix_policy()
    policy.apply_report("a", report("a", H[:10], at=1.0), now=1.0)
    ranks = policy.rank(["a", "b", "c"], H[:20], now=1.5)
    assert all(len(rank) == 1 for rank in ranks)
    assert sorted(r[0] for r in ranks) == ["a", "b", "c"]
    assert first(ranks) == "a"


def test_affinity_same_system_prompt_goes_to_the_same_replica() -> None:
    rng = random.Random(1)
    system = random_tokens(rng, 40 * 16)  # a 640-token shared system prompt
    policy = prefix_policy(seed=1)
    replicas = ["r0", "r1", "r2", "r3"]
    chosen = []
    for i in range(20):
        hashes = prompt_hashes(system + random_tokens(rng, 48))
        replica = first(policy.rank(replicas, hashes, now=float(i)))
        policy.on_request_routed(f"q{i}", replica, hashes, now=float(i))
        policy.on_request_completed(f"q{i}", now=i + 0.5)  # light load: affinity must win
        chosen.append(replica)
    assert len(set(chosen)) == 1
    # The first request: no replica holds it yet, so it goes to its first block's home.
    assert policy.counters == {"prefix_home": 1, "prefix": 19}


def test_prefix_semantics_stop_at_the_first_missing_block() -> None:
    policy = prefix_policy()
    # "a" holds blocks 1..39 but not block 0: none of them is reusable.
    policy.apply_report("a", report("a", H[1:], at=1.0), now=1.0)
    policy.apply_report("b", report("b", H[:3], at=1.0), now=1.0)
    scores = {s.replica_id: s for s in policy.score(["a", "b"], H, now=1.0)}
    assert scores["a"].matched_blocks == 0
    assert scores["b"].matched_blocks == 3
    assert first(policy.rank(["a", "b"], H, now=1.0)) == "b"


def test_spill_over_when_waiting_costs_more_than_recomputing() -> None:
    # Guard off: the cost alone must move the request. 6 cached blocks save 6 units of prefill;
    # each queued request costs 4, so 1 request on the holder keeps it, 2 push the request away.
    policy = prefix_policy(imbalance_abs=1000, **WEIGHTS)
    hashes = H[:6]
    policy.apply_report("a", report("a", hashes, at=1.0, running=1), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    assert first(policy.rank(["a", "b"], hashes, now=1.0)) == "a"
    policy.apply_report("a", report("a", hashes, at=2.0, running=1, waiting=1), now=2.0)
    assert first(policy.rank(["a", "b"], hashes, now=2.0)) == "b"


def test_holder_margin_keeps_the_holder_unless_the_alternative_wins_by_enough() -> None:
    # "a" holds 6 blocks with 2 requests: cost 8 (2 x 4) against 6 (prefill) on "b", so "b" is
    # cheaper by 2. A margin of 0.5 per matched block (3) keeps "a"; 0.25 (1.5) does not.
    def choice(margin: float) -> str:
        policy = prefix_policy(imbalance_abs=1000, holder_margin_per_block=margin, **WEIGHTS)
        policy.apply_report("a", report("a", H[:6], at=1.0, running=1, waiting=1), now=1.0)
        policy.apply_report("b", report("b", [], at=1.0), now=1.0)
        return first(policy.rank(["a", "b"], H[:6], now=1.0))

    assert choice(0.0) == "b"
    assert choice(0.25) == "b"
    assert choice(0.5) == "a"


def test_holder_margin_never_overrides_the_imbalance_guard() -> None:
    policy = prefix_policy(imbalance_abs=8, imbalance_rel=2.0, holder_margin_per_block=100.0)
    policy.apply_report("a", report("a", H, at=1.0, running=9), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    assert policy.rank(["a", "b"], H, now=1.0) == [["b"], ["a"]]


def test_spill_over_counts_requests_routed_since_the_last_report() -> None:
    policy = prefix_policy(imbalance_abs=1000, **WEIGHTS)
    hashes = H[:10]
    policy.apply_report("a", report("a", hashes, at=1.0), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    destinations = []
    for i in range(6):
        replica = first(policy.rank(["a", "b"], hashes, now=2.0 + i))
        policy.on_request_routed(f"q{i}", replica, hashes, now=2.0 + i)
        destinations.append(replica)
    # The holder absorbs requests until 3 are queued there (12 > 10 blocks of prefill), then
    # the other replica gets one, which makes it a holder too.
    assert destinations[:3] == ["a", "a", "a"]
    assert "b" in destinations[3:]


def test_a_cold_request_avoids_a_replica_busy_prefilling_a_long_prompt() -> None:
    # Same request count everywhere, but "a" is chewing through 2000 prompt tokens: a request
    # sent there waits for all of them. With no prefix match anywhere (two choices on the load
    # terms) and with a short match on "a", the request goes to "b".
    for seed in range(20):
        policy = prefix_policy(seed=seed)
        policy.apply_report(
            "a", report("a", H[:2], at=1.0, running=1, pending_prefill_tokens=2000), now=1.0
        )
        policy.apply_report("b", report("b", [], at=1.0, running=1), now=1.0)
        assert first(policy.rank(["a", "b"], [7, 8, 9], now=1.0)) == "b"
        assert first(policy.rank(["a", "b"], H[:4], now=1.0)) == "b"
    # Without the queued-prefill term the two-block match on "a" decides.
    policy = prefix_policy(queued_prefill_cost_per_block=0.0)
    policy.apply_report(
        "a", report("a", H[:2], at=1.0, running=1, pending_prefill_tokens=2000), now=1.0
    )
    policy.apply_report("b", report("b", [], at=1.0, running=1), now=1.0)
    assert first(policy.rank(["a", "b"], H[:4], now=1.0)) == "a"


def test_queued_prefill_of_the_requests_own_prefix_is_not_held_against_the_holder() -> None:
    policy = prefix_policy(**WEIGHTS)
    policy.apply_report("a", report("a", [], at=1.0), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    policy.on_request_routed("q1", "a", H, now=2.0)  # 40 blocks to prefill on "a"
    scores = {s.replica_id: s for s in policy.score(["a", "b"], H[:30], now=2.1)}
    assert scores["a"].queued_prefill_blocks == 10  # 40 queued, 30 of them this prompt's own
    assert scores["a"].cost == 4.0 + 0.5 * 10 < scores["b"].cost == 30.0


def test_imbalance_guard_overrides_a_long_cached_prefix() -> None:
    policy = prefix_policy(imbalance_abs=8, imbalance_rel=2.0)
    policy.apply_report("a", report("a", H, at=1.0, running=9), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    # By cost "a" wins by far (40 blocks saved vs 36 for 9 requests)...
    scores = {s.replica_id: s for s in policy.score(["a", "b"], H, now=1.0)}
    assert scores["a"].cost < scores["b"].cost
    # ...but 9 > 0 + 8 and 9 > 2 * 0: "a" is hot and goes last.
    assert scores["a"].hot and not scores["b"].hot
    assert policy.rank(["a", "b"], H, now=1.0) == [["b"], ["a"]]
    assert policy.counters["guarded"] == 1


def test_imbalance_guard_needs_both_absolute_and_relative_excess() -> None:
    policy = prefix_policy(imbalance_abs=8, imbalance_rel=2.0)
    policy.apply_report("b", report("b", [], at=1.0, running=10), now=1.0)
    # 19 exceeds 10 + 8 but not 2 * 10: not hot, the cache wins.
    policy.apply_report("a", report("a", H, at=1.0, running=19), now=1.0)
    assert first(policy.rank(["a", "b"], H, now=1.0)) == "a"
    # 21 exceeds both.
    policy.apply_report("a", report("a", H, at=2.0, running=21), now=2.0)
    assert first(policy.rank(["a", "b"], H, now=2.0)) == "b"


def test_hot_prefix_is_spread_by_the_guard_not_piled_onto_one_replica() -> None:
    # A load weight so low that the cost alone would send all 60 requests to the first holder.
    policy = prefix_policy(seed=3, load_cost_per_request=0.1, imbalance_abs=4, imbalance_rel=1.5)
    replicas = ["r0", "r1", "r2"]
    counts: Counter[str] = Counter()
    for i in range(60):  # nothing completes: the load only grows
        replica = first(policy.rank(replicas, H, now=float(i)))
        policy.on_request_routed(f"q{i}", replica, H, now=float(i))
        counts[replica] += 1
    loads = [policy.view(r).estimated_load for r in replicas]  # type: ignore[union-attr]
    assert sum(loads) == 60
    # A replica stops receiving once it leads the least loaded one by more than imbalance_abs.
    assert max(loads) - min(loads) <= 4 + 1
    assert policy.counters["guarded"] > 0


def test_fallback_spreads_random_prompts_between_two_replicas() -> None:
    rng = random.Random(7)
    policy = prefix_policy(seed=7)
    counts: Counter[str] = Counter()
    in_flight: list[str] = []
    for i in range(1000):
        hashes = prompt_hashes(random_tokens(rng, rng.randrange(16, 400)))
        replica = first(policy.rank(["a", "b"], hashes, now=float(i)))
        policy.on_request_routed(f"q{i}", replica, hashes, now=float(i))
        counts[replica] += 1
        in_flight.append(f"q{i}")
        if len(in_flight) > 8:  # about 8 requests in flight at any time
            policy.on_request_completed(in_flight.pop(rng.randrange(len(in_flight))), float(i))
    assert max(counts.values()) / 1000 <= 0.65
    assert set(policy.counters) == {"prefix_home", "fallback"}
    assert sum(policy.counters.values()) == 1000


def test_power_of_two_without_prefix_information() -> None:
    policy = prefix_policy()
    policy.apply_report("a", report("a", H, at=1.0, running=5), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    # No block hashes (e.g. a prompt shorter than one block): the less loaded of two wins.
    assert policy.rank(["a", "b"], [], now=1.0) == [["b"], ["a"]]
    assert policy.counters == {"fallback": 1}


def test_min_match_blocks_threshold() -> None:
    policy = prefix_policy(min_match_blocks=4)
    policy.apply_report("a", report("a", H[:3], at=1.0, running=1), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    policy.rank(["a", "b"], H, now=1.0)
    no_match = dict(policy.counters)
    assert sum(no_match.values()) == 1 and set(no_match) <= {"prefix_home", "fallback"}
    policy.apply_report("a", report("a", H[:4], at=2.0, running=1), now=2.0)
    assert first(policy.rank(["a", "b"], H, now=2.0)) == "a"
    assert policy.counters == {**no_match, "prefix": 1}


def test_min_match_zero_joins_the_shortest_queue() -> None:
    policy = prefix_policy(min_match_blocks=0)
    for name, running in (("a", 3), ("b", 1), ("c", 2)):
        policy.apply_report(name, report(name, [], at=1.0, running=running), now=1.0)
    assert policy.rank(["a", "b", "c"], H, now=1.0) == [["b"], ["c"], ["a"]]


def test_directory_blocks_cost_a_transfer_instead_of_a_prefill() -> None:
    policy = prefix_policy(imbalance_abs=1000, **WEIGHTS)
    hashes = H[:20]
    policy.apply_report("a", report("a", hashes[:10], at=1.0, running=2), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0), now=1.0)
    # Without the directory: a = 10 prefill + 2 * 4 load = 18 < b = 20 prefill.
    assert first(policy.rank(["a", "b"], hashes, now=1.0)) == "a"
    # All 20 blocks published: a = 10 * 0.25 + 8 = 10.5 > b = 20 * 0.25 = 5.
    directory = set(hashes)
    scores = {s.replica_id: s for s in policy.score(["a", "b"], hashes, 1.0, directory)}
    assert (scores["a"].matched_blocks, scores["a"].transfer_blocks) == (10, 10)
    assert (scores["b"].transfer_blocks, scores["b"].uncached_blocks) == (20, 0)
    assert scores["a"].cost == pytest.approx(10.5)
    assert scores["b"].cost == pytest.approx(5.0)
    assert first(policy.rank(["a", "b"], hashes, 1.0, directory)) == "b"


def test_a_measured_transfer_cost_replaces_the_configured_one() -> None:
    """A replica that reports its import/prefill speed ratio is priced by it: importing there
    is cheap when fetching is fast, and dearer than recomputing when fetching is slow."""
    policy = prefix_policy(imbalance_abs=1000)
    hashes = H[:20]
    directory = set(hashes)
    for ratio, cost in ((0.05, 1.0), (1.5, 30.0)):
        stats = {**report("b", [], at=ratio), "transfer_cost_ratio": ratio}
        policy.apply_report("b", stats, now=1.0)
        (score,) = policy.score(["b"], hashes, 1.0, directory)
        assert score.transfer_blocks == 20 and score.cost == pytest.approx(cost)
    with pytest.raises(ValueError, match="transfer_cost_ratio"):
        policy.apply_report("c", {**report("c", [], at=1.0), "transfer_cost_ratio": -1}, now=1.0)


def test_directory_transfer_stops_at_a_gap() -> None:
    policy = prefix_policy()
    policy.apply_report("a", report("a", H[:2], at=1.0), now=1.0)
    directory = set(H[:5]) | set(H[6:10])  # block 5 is missing
    (score,) = policy.score(["a"], H[:10], 1.0, directory)
    assert (score.matched_blocks, score.transfer_blocks, score.uncached_blocks) == (2, 3, 5)


def test_round_robin_cycles_in_id_order() -> None:
    policy = make_policy("round_robin", rng=random.Random(0))
    firsts = [first(policy.rank(["c", "a", "b"], H, now=0.0)) for _ in range(6)]
    assert sorted(firsts[:3]) == ["a", "b", "c"]
    assert firsts[3:] == firsts[:3]
    assert len(policy.rank(["c", "a", "b"], H, now=0.0)) == 3
    assert policy.rank([], H, now=0.0) == []


def test_power_of_two_prefers_the_less_loaded_of_its_sample() -> None:
    policy = make_policy("power_of_two", rng=random.Random(0))
    policy.apply_report("a", report("a", H, at=1.0, running=7), now=1.0)
    policy.apply_report("b", report("b", [], at=1.0, running=1), now=1.0)
    # With two candidates the sample is both: the less loaded one first, cache ignored.
    for _ in range(5):
        assert policy.rank(["a", "b"], H, now=1.0) == [["b"], ["a"]]
    assert policy.rank(["a"], H, now=1.0) == [["a"]]
    assert policy.rank([], H, now=1.0) == []


def test_same_seed_same_decisions() -> None:
    def run(seed: int) -> list[str]:
        rng = random.Random(99)
        policy = prefix_policy(seed=seed)
        out = []
        for i in range(200):
            hashes = prompt_hashes(random_tokens(rng, 64))[: rng.randrange(0, 5)]
            replica = first(policy.rank(["a", "b", "c", "d"], hashes, now=float(i)))
            policy.on_request_routed(f"q{i}", replica, hashes, now=float(i))
            out.append(replica)
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_make_policy_names_and_errors() -> None:
    for name in ("prefix_aware", "power_of_two", "round_robin"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown routing policy 'least_loaded'"):
        make_policy("least_loaded")
    policy = make_policy("prefix_aware", {"imbalance_abs": 3, "stats_period_s": 0.5})
    assert policy.config.imbalance_abs == 3


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    held=st.lists(st.integers(0, 12), min_size=6, max_size=6),
    n=st.integers(0, 12),
    seed=st.integers(0, 3),
)
def test_rank_is_a_permutation_with_hot_replicas_last_and_costs_sorted(
    loads: list[int], held: list[int], n: int, seed: int
) -> None:
    policy = prefix_policy(seed=seed, imbalance_abs=5, imbalance_rel=1.5)
    names = [f"r{i}" for i in range(len(loads))]
    for name, load, k in zip(names, loads, held, strict=False):
        policy.apply_report(name, report(name, H[:k], at=1.0, running=load), now=1.0)
    ranks = policy.rank(names, H[:n], now=1.0)
    assert all(len(rank) == 1 for rank in ranks)
    assert sorted(r[0] for r in ranks) == sorted(names)
    if policy.counters.get("fallback") or policy.counters.get("prefix_home"):
        return
    scores = {s.replica_id: s for s in policy.score(names, H[:n], now=1.0)}
    ordered = [scores[r[0]] for r in ranks]
    keys = [(s.hot, s.cost) for s in ordered]
    assert keys == sorted(keys)
    assert any(not s.hot for s in ordered)  # the least loaded replica is never hot


def test_a_prompt_nobody_holds_goes_where_the_cache_evicts_the_oldest_blocks() -> None:
    # Capacity 10 per replica. "a" wrote its last 10 blocks after 1.0, "b" after 2.0; "c" has
    # written only 4 (its cache is not full), so a new prompt evicts nothing there.
    policy = prefix_policy(evict_oldest=True)
    writes = {"a": [(1.0, range(0, 12))], "b": [(1.0, range(100, 104)), (2.0, range(100, 114))]}
    writes["c"] = [(1.0, range(200, 204))]
    for replica, reports in writes.items():
        for at, hashes in reports:
            policy.apply_report(replica, report(replica, hashes, at=at, total=10), now=at)
    new_prompt = list(range(1000, 1006))
    assert first(policy.rank(["a", "b", "c"], new_prompt, 3.0)) == "c"
    assert first(policy.rank(["a", "b"], new_prompt, 3.0)) == "a"  # both full: a's are older
    assert policy.counters == {"evict_oldest": 2}
    # A candidate busier than the least loaded by more than one request is passed over.
    policy.apply_report("c", report("c", range(200, 204), at=3.5, total=10, running=2), 3.5)
    assert first(policy.rank(["a", "b", "c"], new_prompt, 4.0)) == "a"
    # Off: the prompt's home or the better of two random replicas, as before.
    off = prefix_policy(evict_oldest=False)
    off.rank(["a", "b", "c"], new_prompt, 3.0)
    assert set(off.counters) <= {"prefix_home", "fallback"}


def test_a_new_prompt_goes_where_the_oldest_block_was_written_earliest_in_a_report_period() -> None:
    # Both caches (capacity 10) filled by 1.0 and rewrote themselves between 1.0 and 2.0; by
    # 3.0 "a" wrote 8 more blocks and "b" 2, so a's oldest block left is the 9th of those written
    # between 1.0 and 2.0 and b's the 3rd. Both were reported at 2.0: the report period is
    # split by the writes in it, and the prompt goes to "b", whose blocks to evict are older
    # (not to "a", the least replica id, on a tie at the report's time).
    policy = prefix_policy(evict_oldest=True)
    for r, base, more in (("a", 0, 8), ("b", 100, 2)):
        for at, start in ((1.0, base), (2.0, base + 10), (3.0, base + 10 + more)):
            policy.apply_report(r, report(r, range(start, start + 10), at=at, total=10), now=at)
    assert first(policy.rank(["a", "b"], list(range(1000, 1006)), 3.5)) == "b"
    assert policy.counters == {"evict_oldest": 1}


def test_cold_prompts_spread_over_equal_replicas_by_what_each_has_written() -> None:
    # Reports show how much each replica wrote: routing cold prompts to the fewest written,
    # report after report, keeps the replicas' writes within one prompt of each other.
    policy = prefix_policy(evict_oldest=True)
    replicas = ["a", "b", "c", "d"]
    cached: dict[str, list[int]] = {r: [] for r in replicas}
    rng = random.Random(5)
    next_hash = 0
    for step in range(40):
        now = 1.0 + step
        for r in replicas:
            policy.apply_report(r, report(r, cached[r], at=now, total=10_000), now=now)
        size = rng.randrange(1, 30)
        prompt = list(range(next_hash, next_hash + size))
        next_hash += size
        went = first(policy.rank(replicas, prompt, now + 0.5))
        cached[went].extend(prompt)
    written = [len(cached[r]) for r in replicas]
    assert max(written) - min(written) < 30
    assert policy.counters == {"evict_oldest": 40}
