"""engine.gc_heap: the start-up heap leaves the collector's generations."""

from __future__ import annotations

from tests.helpers import run_python


def test_freeze_moves_live_objects_out_of_full_collections() -> None:
    # In a child: freezing is process-wide and would keep this test process's heap forever.
    code = """
import gc
from engine.gc_heap import freeze_startup_heap

class Node:
    def __init__(self):
        self.me = self

keep = [Node() for _ in range(50_000)]
garbage = [Node() for _ in range(1_000)]
del garbage  # a cycle each: only the collector frees them
before = len(gc.get_objects())
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count() >= 50_000, frozen
# The garbage went in the collection before the freeze; the kept objects left every generation.
assert len(gc.get_objects()) < before - 50_000, (len(gc.get_objects()), before)
assert all(n.me is n for n in keep)
# New cycles are still collected.
for _ in range(10):
    Node()
assert gc.collect() >= 10
print("ok")
"""
    assert run_python(code) == "ok"
