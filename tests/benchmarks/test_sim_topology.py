"""Nodes in the simulator: replicas placed ``replicas_per_node`` to a node report their node and
measured transfer costs, imports from another node's object store take longer, and the router's
node-aware pricing keeps imports on the publisher's node."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from benchmarks import simulate
from benchmarks.sim import sharing
from benchmarks.sim.cluster import Cluster, ClusterConfig, ClusterRun
from benchmarks.sim.profile import CROSS_NODE_EXTRA_BLOCK_S, Profile, StepCost
from benchmarks.sim.trace import SimRequestSpec, load_trace
from tests.benchmarks.test_simulate import BLOCK, _record, _write_trace

PROFILE = Profile(
    "test",
    StepCost(base_s=0.001, prefill_token_s=1e-5, decode_seq_s=2e-4),
    transfer_block_s=1e-5,
    transfer_cross_node_block_s=2e-4,
)


def _specs(tmp_path: Path) -> list[SimRequestSpec]:
    rng = random.Random(7)
    # 8 system prompts of 12 blocks, each shared by many requests with their own 4-block
    # questions, arriving faster than their holders serve them: some go elsewhere and import.
    records = []
    for i in range(160):
        group = rng.randrange(8)
        hash_ids = [1000 * group + k for k in range(12)] + [50_000 + 4 * i + q for q in range(4)]
        records.append(_record(10 * i, hash_ids, out=64))
    return load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)


def _run(specs: list[SimRequestSpec], **kw: Any) -> ClusterRun:
    config = ClusterConfig(
        replicas=8,
        capacity_blocks=1000,
        block_tokens=BLOCK,
        kv_sharing=True,
        router_config={"imbalance_abs": 4, "imbalance_rel": 1.0},
        **kw,
    )
    return Cluster(PROFILE, config).run(specs)


def test_the_profile_prices_cross_node_blocks_apart() -> None:
    assert PROFILE.transfer_s(10, BLOCK) == pytest.approx(10 * 1e-5)
    assert PROFILE.transfer_s(10, BLOCK, cross_node_blocks=4) == pytest.approx(6e-5 + 8e-4)
    assert PROFILE.transfer_s(10, 2 * BLOCK, cross_node_blocks=4) == pytest.approx(2 * 8.6e-4)
    assert PROFILE.transfer_cost_ratios() == (pytest.approx(1e-5 / 16e-5), pytest.approx(1.25))
    measured = Profile("m", PROFILE.step, transfer_block_s=1e-4)
    assert measured.cross_node_block_s == pytest.approx(1e-4 + CROSS_NODE_EXTRA_BLOCK_S)
    with pytest.raises(ValueError, match="transfer_cross_node_block_s"):
        Profile("bad", PROFILE.step, transfer_cross_node_block_s=-1.0)
    with pytest.raises(ValueError, match="replicas_per_node"):
        ClusterConfig(replicas=2, capacity_blocks=10, replicas_per_node=0)


def test_replicas_report_their_nodes_and_imports_stay_on_the_publishers_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = _specs(tmp_path)
    aware = _run(specs, replicas_per_node=4)
    for i, replica in enumerate(aware.replicas):
        view = aware.policy.view(replica.replica_id)
        assert view.node_id == f"node-{i // 4}"
        assert view.cross_node_transfer_cost_ratio == pytest.approx(1.25)
    assert aware.directory is not None and aware.directory.imported_blocks > 0
    # The same cluster with a router that cannot see where blocks were published.
    monkeypatch.setattr(sharing.SimDirectory, "located", property(lambda d: d.hashes))
    blind = _run(specs, replicas_per_node=4)
    assert blind.directory is not None
    aware_share = aware.directory.imported_cross_node_blocks / aware.directory.imported_blocks
    blind_share = blind.directory.imported_cross_node_blocks / blind.directory.imported_blocks
    assert blind.directory.imported_blocks > 0
    assert aware_share < blind_share


def test_without_nodes_reports_carry_none_and_the_output_is_unchanged(tmp_path: Path) -> None:
    specs = _specs(tmp_path)
    run = _run(specs)
    assert all(run.policy.view(r.replica_id).node_id is None for r in run.replicas)
    assert run.directory is not None and run.directory.imported_cross_node_blocks == 0
    trace = tmp_path / "t.jsonl"
    base = ["--trace", str(trace), "--replicas", "4", "--block-tokens", str(BLOCK), "--quiet"]
    plain = simulate.main([*base, "--kv-sharing"])["runs"][0]
    placed = simulate.main([*base, "--kv-sharing", "--replicas-per-node", "2"])["runs"][0]
    assert "replicas_per_node" not in plain and "cross_node_fetched_blocks" not in plain
    assert placed["replicas_per_node"] == 2 and placed["cross_node_fetched_blocks"] >= 0
