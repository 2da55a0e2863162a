"""glibc keeps the memory of freed activations for the next step once the engine tuned it."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A fresh interpreter per case: malloc's thresholds adapt to what a process has freed.
PROGRAM = """
import json, sys, torch
from engine.allocator import keep_freed_memory

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            return lo, hi
    return 0, 0

tuned = sys.argv[1] == "tune" and keep_freed_memory()
x = torch.empty(24 << 20, dtype=torch.uint8)  # an activation of a prefill step
x.fill_(1)
lo, hi = heap()
in_heap = lo <= x.data_ptr() < hi
del x
lo, hi = heap()
print(json.dumps({"tuned": tuned, "in_heap": in_heap, "heap_after_free": hi - lo}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")
def test_large_activations_come_from_the_heap_and_stay_there_after_free() -> None:
    default, tuned = _run("default"), _run("tune")
    # By default a block this large is a mapping of its own, unmapped on free: the next step
    # page-faults it in again.
    assert not default["tuned"] and not default["in_heap"]
    assert tuned["tuned"] and tuned["in_heap"]
    assert tuned["heap_after_free"] >= 24 << 20
