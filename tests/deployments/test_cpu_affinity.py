"""Which CPUs an engine replica pins its thread to (pure: no Ray cluster)."""

from __future__ import annotations

import pytest

from deployments.config import AppArgs
from deployments.cpu_affinity import engine_cpus

TWO = [0, 1]
EIGHT = list(range(8))


@pytest.mark.parametrize(
    ("local_rank", "num_cpus", "allowed", "node_cpus", "expected"),
    [
        # The shipped layout: two 1-CPU replicas on a 2-core box Ray owns.
        (0, 1, TWO, 2, {0}),
        (1, 1, TWO, 2, {1}),
        # A third replica has no core of its own left.
        (2, 1, TWO, 2, None),
        # Wider replicas take consecutive slots; the affinity set need not start at 0.
        (1, 2, [4, 5, 6, 7], 4, {6, 7}),
        (0, 3, EIGHT, 8, {0, 1, 2}),
        # Ray declares fewer CPUs than the process sees (a pod's quota on a shared node).
        (0, 1, EIGHT, 2, None),
        # ... or more (a test cluster's num_cpus=4 on 2 cores).
        (0, 1, TWO, 4, None),
        # Fractional, zero or missing CPU requests are never pinned.
        (0, 0.5, TWO, 2, None),
        (0, 1.5, EIGHT, 8, None),
        (0, 0, TWO, 2, None),
        (0, None, TWO, 2, None),
        # Unknown node resources or rank.
        (0, 1, TWO, None, None),
        (-1, 1, TWO, 2, None),
    ],
)
def test_engine_cpus(local_rank, num_cpus, allowed, node_cpus, expected) -> None:
    got = engine_cpus(local_rank, num_cpus, allowed, node_cpus)
    assert got == (None if expected is None else frozenset(expected))


def test_pinning_is_on_by_default_and_can_be_turned_off() -> None:
    assert AppArgs().pin_engine_cpus is True
    assert AppArgs.model_validate({"pin_engine_cpus": False}).pin_engine_cpus is False
