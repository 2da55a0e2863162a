"""A replica's import cost, measured apart for objects published on its own node and elsewhere."""

from __future__ import annotations

import pytest

from deployments.import_cost import ALPHA, ImportCost


def test_fetches_are_classified_by_the_publishers_node() -> None:
    cost = ImportCost("node-a")
    cost.observe(0.010, 10, ["node-a", "node-a"])
    assert (cost.same_node_s_per_block, cost.cross_node_s_per_block) == (0.001, None)
    cost.observe(0.050, 10, ["node-b"])
    assert cost.cross_node_s_per_block == pytest.approx(0.005)
    assert cost.same_node_s_per_block == 0.001  # untouched by a cross-node fetch
    # The next sample of each kind moves only its own average, by ALPHA of the difference.
    cost.observe(0.030, 10, ["node-a"])
    assert cost.same_node_s_per_block == pytest.approx(0.001 + ALPHA * 0.002)
    cost.observe(0.010, 10, ["node-c"])
    assert cost.cross_node_s_per_block == pytest.approx(0.005 + ALPHA * (0.001 - 0.005))


def test_a_mixed_fetch_is_cross_node_and_unknown_publishers_are_local() -> None:
    cost = ImportCost("node-a")
    assert cost.crosses_nodes(["node-a", "node-b"])
    assert not cost.crosses_nodes(["node-a", None])
    cost.observe(0.02, 4, [None])
    assert cost.same_node_s_per_block == pytest.approx(0.005)
    assert cost.cross_node_s_per_block is None
    # A replica that does not know its own node counts everything as local.
    unknown = ImportCost(None)
    unknown.observe(0.02, 4, ["node-b"])
    assert (unknown.same_node_s_per_block, unknown.cross_node_s_per_block) == (0.005, None)
    cost.observe(1.0, 0, ["node-b"])  # nothing fetched: nothing learnt
    assert cost.cross_node_s_per_block is None


def test_ratios_divide_by_the_prefill_time_of_a_block() -> None:
    cost = ImportCost("node-a")
    assert cost.ratios(0.01) == (None, None)
    cost.observe(0.004, 4, ["node-a"])
    assert cost.ratios(0.01) == (pytest.approx(0.1), None)
    assert cost.ratios(None) == (None, None)  # prefill speed not measured yet
    cost.observe(0.02, 4, ["node-b"])
    assert cost.ratios(0.01) == (pytest.approx(0.1), pytest.approx(0.5))
