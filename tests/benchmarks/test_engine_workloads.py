"""The offline workloads both engines run (benchmarks.engine_workloads) and how compare_vllm
turns their rounds into ratios."""

from __future__ import annotations

import pytest

from benchmarks import engine_workloads as wl
from benchmarks.compare_vllm import summarize


def test_the_wave_is_a_cold_burst_of_one_prefill_step() -> None:
    work = wl.by_name("wave")
    assert work.max_tokens == 1 and not work.prefix_caching
    assert len(work.prompts) == 20 and {len(p) for p in work.prompts} == {100}
    assert len({tuple(p) for p in work.prompts}) == 20  # distinct: nothing to share
    assert all(wl.LOW_TOKEN <= t < wl.HIGH_TOKEN for p in work.prompts for t in p)
    assert wl.by_name("wave").prompts == work.prompts  # the same prompts for both engines


def test_the_wave_reports_the_milliseconds_of_one_run() -> None:
    calls: list[tuple[str, int]] = []

    def generate(work: wl.Workload, max_tokens: int) -> float:
        calls.append((work.name, max_tokens))
        return 0.4321

    assert wl.measure_once("wave", generate, 64) == {"wave_ms": 432.1}
    assert calls == [("wave", 1)]


@pytest.mark.parametrize(
    ("name", "key", "vllm", "ours", "best", "paired"),
    [
        # Latencies: vLLM / ours, so > 1 is ours ahead.
        ("wave", "wave_ms", [800.0, 700.0, 900.0], [400.0, 700.0, 600.0], 1.75, 1.5),
        ("batch1", "ms_per_token", [30.0, 20.0, 25.0], [10.0, 20.0, 12.5], 2.0, 2.0),
        # Throughput: ours / vLLM.
        ("w1", "tok_s", [100.0, 200.0, 150.0], [150.0, 200.0, 300.0], 1.5, 1.5),
    ],
)
def test_ratios_say_how_far_ours_is_ahead_whatever_the_metric(
    name: str, key: str, vllm: list[float], ours: list[float], best: float, paired: float
) -> None:
    got = summarize(name, [{key: v} for v in vllm], [{key: o} for o in ours])
    assert got["metric"] == key
    assert got["ratio_best"] == best and got["ratio_paired_median"] == paired
