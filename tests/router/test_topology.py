"""Topology-aware import pricing: replicas report their Ray node and two measured transfer costs,
the directory hint says which nodes published each block, and a transfer is priced by whether
the candidate shares the publisher's node."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from router import PrefixAwarePolicy, PublishedBlocks, ReplicaReport, RouterConfig, make_policy
from router.topology import BlockLocations, remote_block_counts, transfer_weights
from tests.router.support import report
from tests.router.test_request_router import (
    EngineRequest,
    FakeReplica,
    ids,
    make_router,
    pending,
    run,
    settle,
)

H = list(range(2000, 2030))


def policy(seed: int = 0, **options: Any) -> PrefixAwarePolicy:
    p = make_policy("prefix_aware", RouterConfig(**options), rng=random.Random(seed))
    assert isinstance(p, PrefixAwarePolicy)
    return p


def placed(
    replica_id: str,
    node: str | None,
    hashes: list[int] = (),  # type: ignore[assignment]
    *,
    same: float | None = None,
    cross: float | None = None,
    at: float = 1.0,
    running: int = 0,
) -> dict[str, Any]:
    stats = report(replica_id, hashes, at=at, running=running)
    for key, value in (
        ("node_id", node),
        ("transfer_cost_ratio", same),
        ("cross_node_transfer_cost_ratio", cross),
    ):
        if value is not None:
            stats[key] = value
    return stats


def published_on(node_of: dict[int, str]) -> PublishedBlocks:
    return PublishedBlocks({h: frozenset({n}) for h, n in node_of.items()})


def test_a_candidate_on_the_publishing_node_wins_over_an_equal_one_elsewhere() -> None:
    hashes = H[:20]
    directory = published_on(dict.fromkeys(hashes, "n1"))
    for seed in range(20):
        p = policy(seed)
        # The publisher holds the prefix but is overloaded (the imbalance guard ranks it last).
        p.apply_report("a", placed("a", "n1", hashes, running=20), now=1.0)
        p.apply_report("b", placed("b", "n1", same=0.1, cross=1.0), now=1.0)
        p.apply_report("c", placed("c", "n2", same=0.1, cross=1.0), now=1.0)
        assert p.rank(["c", "a", "b"], hashes, 1.0, directory) == [["b"], ["c"], ["a"]]
    b, c = p.score(["b", "c"], hashes, 1.0, directory)
    assert (b.transfer_blocks, b.cross_node_blocks, b.cost) == (20, 0, pytest.approx(2.0))
    assert (c.transfer_blocks, c.cross_node_blocks, c.cost) == (20, 20, pytest.approx(20.0))


def test_equal_costs_across_nodes_leave_the_choice_to_the_tie_break() -> None:
    hashes = H[:20]
    directory = published_on(dict.fromkeys(hashes, "n1"))
    firsts = set()
    for seed in range(20):
        p = policy(seed)
        p.apply_report("a", placed("a", "n1", hashes, running=20), now=1.0)
        p.apply_report("b", placed("b", "n1", same=0.1, cross=0.1), now=1.0)
        p.apply_report("c", placed("c", "n2", same=0.1, cross=0.1), now=1.0)
        firsts.add(p.rank(["a", "b", "c"], hashes, 1.0, directory)[0][0])
    assert firsts == {"b", "c"}


def test_a_run_is_priced_block_by_block_from_the_candidates_own_match() -> None:
    # Blocks 0-9 published on n1, 10-19 on n2, 20-24 by a replica of unknown node.
    directory = PublishedBlocks(
        {
            **{h: frozenset({"n1"}) for h in H[:10]},
            **{h: frozenset({"n2"}) for h in H[10:20]},
            **{h: frozenset() for h in H[20:25]},
        }
    )
    p = policy(imbalance_abs=1000)
    p.apply_report("b", placed("b", "n1", H[:4], same=0.1, cross=0.5), now=1.0)
    (b,) = p.score(["b"], H[:25], 1.0, directory)
    # b holds 4 blocks; of the 21 it imports, the 10 from n2 cross nodes, the unknown 5 do not.
    assert (b.matched_blocks, b.transfer_blocks, b.cross_node_blocks) == (4, 21, 10)
    assert b.cost == pytest.approx(11 * 0.1 + 10 * 0.5)


def test_unmeasured_cross_node_cost_falls_back_to_same_node_then_configured() -> None:
    hashes = H[:20]
    directory = published_on(dict.fromkeys(hashes, "n1"))
    p = policy(transfer_cost_per_block=0.25, imbalance_abs=1000)
    p.apply_report("c", placed("c", "n2"), now=1.0)
    (c,) = p.score(["c"], hashes, 1.0, directory)
    assert c.cross_node_blocks == 20 and c.cost == pytest.approx(20 * 0.25)
    p.apply_report("c", placed("c", "n2", same=0.1, at=2.0), now=2.0)
    (c,) = p.score(["c"], hashes, 2.0, directory)
    assert c.cost == pytest.approx(20 * 0.1)
    p.apply_report("c", placed("c", "n2", same=0.1, cross=0.8, at=3.0), now=3.0)
    (c,) = p.score(["c"], hashes, 3.0, directory)
    assert c.cost == pytest.approx(20 * 0.8)
    assert transfer_weights(2.0, 0.25, None, 0.5) == (0.25, 1.0)


def test_without_nodes_every_transfer_is_priced_as_before() -> None:
    """A plain set of hashes, or a replica of unknown node: the same-node figure for all."""
    hashes = H[:20]
    p = policy(imbalance_abs=1000)
    p.apply_report("c", placed("c", "n2", same=0.1, cross=1.0), now=1.0)
    p.apply_report("d", placed("d", None, same=0.1, cross=1.0), now=1.0)
    (c,) = p.score(["c"], hashes, 1.0, set(hashes))
    assert (c.cross_node_blocks, c.cost) == (0, pytest.approx(2.0))
    (d,) = p.score(["d"], hashes, 1.0, published_on(dict.fromkeys(hashes, "n1")))
    assert (d.cross_node_blocks, d.cost) == (0, pytest.approx(2.0))
    assert remote_block_counts(hashes, set(hashes), ["n1"]) is None
    assert remote_block_counts(hashes, published_on({}), [None]) is None


def test_a_block_published_on_several_nodes_is_local_to_each() -> None:
    directory = PublishedBlocks({h: frozenset({"n1", "n2"}) for h in H[:3]})
    assert isinstance(directory, BlockLocations)
    counts = remote_block_counts(H[:4], directory, ["n1", "n2", "n3"])
    assert counts == {"n1": [0, 0, 0, 0, 0], "n2": [0, 0, 0, 0, 0], "n3": [0, 1, 2, 3, 3]}


def test_report_validation_of_the_topology_keys() -> None:
    old = report("a", [1], at=1.0)  # a replica of an older build reports neither key
    parsed = ReplicaReport.from_dict(old)
    assert parsed.node_id is None and parsed.cross_node_transfer_cost_ratio is None
    new = ReplicaReport.from_dict(placed("a", "n1", [1], same=0.2, cross=3))
    assert new.node_id == "n1"
    assert new.transfer_cost_ratio == 0.2 and new.cross_node_transfer_cost_ratio == 3.0
    assert isinstance(new.cross_node_transfer_cost_ratio, float)
    for key, value in (
        ("node_id", ""),
        ("node_id", 7),
        ("node_id", ["n1"]),
        ("cross_node_transfer_cost_ratio", -0.5),
        ("cross_node_transfer_cost_ratio", float("inf")),
        ("cross_node_transfer_cost_ratio", "1.0"),
        ("cross_node_transfer_cost_ratio", True),
    ):
        with pytest.raises(ValueError, match=key):
            ReplicaReport.from_dict({**old, key: value})
    p = policy()
    p.apply_report("a", placed("a", "n1", same=0.2, cross=3.0), now=1.0)
    view = p.view("a")
    assert view is not None and view.node_id == "n1"
    assert (view.transfer_cost_ratio, view.cross_node_transfer_cost_ratio) == (0.2, 3.0)


def test_serve_router_prices_imports_by_the_nodes_of_the_replicas_holding_the_prefix() -> None:
    """With KV sharing the holders' nodes stand in for the publishers': of two idle replicas
    that would import a busy holder's prefix, the one on the holder's node goes first."""

    async def body() -> None:
        router = make_router(kv_sharing=True, imbalance_abs=100, load_cost_per_request=4.0)
        now = time.time()
        a = FakeReplica("a", placed("a", "n1", H, at=now, running=5))
        b = FakeReplica("b", placed("b", "n1", at=now, same=0.05, cross=0.5))
        c = FakeReplica("c", placed("c", "n2", at=now, same=0.05, cross=0.5))
        router.update_replicas([a, b, c])
        await settle()
        request = pending(EngineRequest(block_hashes=H))
        # 30 blocks: 1.5 on b (same node), 15 on c (cross node), a's load of 5 costs 20.
        assert ids(await router.choose_replicas([c, a, b], request)) == [["b"], ["c"], ["a"]]

    run(body)
