"""Choosing a handed-off request's decode replica by its inter-token SLO (router.slo)."""

from __future__ import annotations

import pytest

from router.slo import SloVerdicts, predicted_step_s, prefer_within_slo
from router.state import ClusterState
from tests.router.support import report

NOW = 100.0


def state(**replicas: tuple[int, float | None]) -> ClusterState:
    """Replicas reporting (running sequences, decode step seconds)."""
    s = ClusterState(decision_ttl_s=30.0)
    for name, (running, step_s) in replicas.items():
        s.apply_report(
            name, {**report(name, at=NOW, running=running), "decode_step_s": step_s}, NOW
        )
    return s


def test_one_more_stream_is_priced_at_each_streams_share_of_a_step() -> None:
    s = state(a=(4, 0.040), idle=(0, None), fresh=(2, None))
    assert predicted_step_s(s.views["a"]) == pytest.approx(0.050)
    # Requests this router sent since the report join the streams.
    s.on_request_routed("r1", "a", [], NOW + 0.1)
    s.on_request_routed("r2", "a", [], NOW + 0.2)
    assert predicted_step_s(s.views["a"]) == pytest.approx(0.070)
    assert predicted_step_s(s.views["idle"]) is None
    assert predicted_step_s(s.views["fresh"]) is None
    assert predicted_step_s(None) is None


def test_the_replica_that_keeps_the_slo_wins_over_the_better_ranked_one() -> None:
    # b holds the KV (ranked first by the policy) but decodes 8 streams at 40 ms a step.
    s = state(a=(2, 0.020), b=(8, 0.040), c=(4, 0.045))
    ranks, met = prefer_within_slo([["b"], ["c"], ["a"]], s.views, slo_ms=40.0)
    assert (ranks, met) == ([["a"], ["b"], ["c"]], True)
    # A looser SLO that b keeps (45 ms with a ninth stream) leaves the policy's order alone.
    ranks, met = prefer_within_slo([["b"], ["c"], ["a"]], s.views, slo_ms=46.0)
    assert (ranks, met) == ([["b"], ["a"], ["c"]], True)


def test_when_no_replica_keeps_it_the_best_still_gets_the_request() -> None:
    s = state(a=(2, 0.050), b=(8, 0.040))
    ranks, met = prefer_within_slo([["b"], ["a"]], s.views, slo_ms=20.0)
    assert (ranks, met) == ([["b"], ["a"]], False)


def test_a_replica_with_nothing_decoding_keeps_any_slo() -> None:
    s = state(busy=(8, 0.040), idle=(0, None))
    ranks, met = prefer_within_slo([["busy"], ["idle"], ["unknown"]], s.views, slo_ms=1.0)
    assert (ranks, met) == ([["idle"], ["unknown"], ["busy"]], True)


def test_reports_must_carry_a_sane_decode_step_time() -> None:
    s = ClusterState(decision_ttl_s=30.0)
    with pytest.raises(ValueError, match="decode_step_s"):
        s.apply_report("a", {**report("a", at=NOW), "decode_step_s": -1.0}, NOW)
    assert s.apply_report("a", report("a", at=NOW), NOW)  # absent: not measured
    assert s.views["a"].decode_step_s is None


def test_verdicts_are_taken_once_and_bounded() -> None:
    verdicts = SloVerdicts(capacity=2)
    verdicts.record("r1", True)
    verdicts.record("r1", False)  # ranked again: the latest wins
    verdicts.record("r2", True)
    verdicts.record("r3", True)  # r1 was never taken: dropped
    assert verdicts.take("r1") is None
    assert verdicts.take("r2") is True
    assert verdicts.take("r2") is None
