"""benchmarks.process_cpu: naming processes by their Ray role and CPU deltas between readings."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from benchmarks import process_cpu


def _started(argv0: str) -> subprocess.Popen[bytes]:
    """A process whose command line starts with ``argv0``, as Ray's workers retitle theirs."""
    return subprocess.Popen(["bash", "-c", f'exec -a "{argv0}" sleep 30'])


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("ray::ServeReplica:prefixserve:Engine", "ray::ServeReplica:prefixserve:Engine"),
        ("ray::ServeController.listen_for_change", "ray::ServeController.listen_for_change"),
        ("/x/site-packages/ray/core/src/ray/gcs/gcs_server", "gcs_server"),
        ("/x/ray/dashboard/agent.py", "dashboard agent"),
    ],
)
def test_role_names_a_process_by_its_command_line(argv0: str, expected: str) -> None:
    proc = _started(argv0)
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(proc.pid).cmdline()[:1] != [argv0]:
            assert time.monotonic() < deadline, "the child never took its title"
            time.sleep(0.01)
        assert process_cpu.role(psutil.Process(proc.pid)) == expected
    finally:
        proc.kill()
        proc.wait()


def test_delta_sums_rows_and_counts_new_processes_from_zero() -> None:
    m = process_cpu.MACHINE
    before = {1: ("raylet", 2.0), 2: ("ray::IDLE", 1.0), 3: ("ray::IDLE", 5.0), m: ("", 100.0)}
    after = {1: ("raylet", 2.5), 2: ("ray::IDLE", 1.25), 4: ("ray::IDLE", 0.5), m: ("", 103.0)}
    rows = process_cpu.delta(before, after)
    # pid 3 exited (lost), pid 4 is new (counts from zero).
    assert rows == {"raylet": 0.5, "ray::IDLE": 0.75, "machine busy": 3.0}
    assert process_cpu.not_engine({**rows, "ray::ServeReplica:a:b": 9.0, "client": 1.0}) == 1.25


def test_snapshot_reads_this_process_in_its_session() -> None:
    snap = process_cpu.snapshot(os.getsid(0))
    name, cpu = snap[os.getpid()]
    assert name != "other"
    assert cpu == pytest.approx(sum(psutil.Process().cpu_times()[:2]), abs=0.5)
    assert snap[process_cpu.MACHINE][1] > 0
