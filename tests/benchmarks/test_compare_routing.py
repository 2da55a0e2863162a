"""The live routing comparison's set-up, without starting a service."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import compare_routing
from deployments.config import AppArgs


def test_every_default_policy_runs_routed_on_two_one_core_engines() -> None:
    assert compare_routing.POLICIES == ("prefix_aware", "ray_prefix_affinity", "power_of_two")
    args = argparse.Namespace(layout="routed", kv_sharing=False)
    for policy in compare_routing.POLICIES:
        app = compare_routing.service_config(policy, args)["applications"][0]
        parsed = AppArgs.model_validate(app["args"])
        assert (parsed.layout, parsed.routing_policy) == ("routed", policy)
        assert not parsed.kv_sharing.enabled
        assert parsed.stream_interval_ms == 20.0
        deployments = {d["name"]: d for d in app["deployments"]}
        assert deployments["Engine"]["num_replicas"] == 2
        assert deployments["Engine"]["ray_actor_options"] == {"num_cpus": 1}
        assert deployments["Ingress"]["ray_actor_options"] == {"num_cpus": 0}


def test_a_bad_policy_or_layout_is_refused_before_any_service_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        compare_routing.main(
            ["--layout", "direct", "--policies", "prefix_aware,ray_prefix_affinity"]
        )
    assert "ray_prefix_affinity needs layout: routed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_routing.main(["--policies", "prefix_awre"])
    assert "routing_policy" in capsys.readouterr().err


def test_rounds_are_summarized_by_their_medians() -> None:
    def run(policy: str, p50: float, share: float | None, hit: float | None = 0.5) -> dict:
        return {
            "policy": policy,
            "workload": "shared-prefix",
            "completed": 48,
            "failed": 1,
            "hit_ratio": hit,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": 10 * p50,
            "output_tok_s": 40.0,
            "req_s": 2.0,
            "max_replica_share": share,
        }

    runs = [run("a", 300, 0.5), run("b", 900, 0.6), run("a", 100, 0.7, None), run("a", 200, None)]
    a, b = compare_routing.medians(runs)
    assert (a["policy"], a["rounds"], a["completed"], a["failed"]) == ("a", 3, 144, 3)
    assert (a["ttft_p50_ms"], a["ttft_p99_ms"], a["hit_ratio"]) == (200, 2000, 0.5)
    assert a["max_replica_share"] == 0.7
    assert (b["policy"], b["rounds"], b["ttft_p50_ms"]) == ("b", 1, 900)


def test_rounds_take_the_policies_in_turn() -> None:
    policies = ["prefix_aware", "ray_prefix_affinity", "power_of_two"]
    orders = [compare_routing.round_order(policies, r) for r in range(3)]
    assert orders[0] == policies
    for order in orders:
        assert sorted(order) == sorted(policies)
    # Over as many rounds as policies, each policy runs once in every position.
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(policies)
    assert compare_routing.round_order(policies, 3) == policies
    assert compare_routing.round_order([], 1) == []
