"""deployments/ has no import cycle, by the same reading of its ``import`` statements as
engine/'s (``tests/engine/test_import_graph.py``)."""

from __future__ import annotations

from tests.engine.test_import_graph import ROOT, find_cycle, import_graph


def test_deployments_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, "deployments")
    assert len(graph) > 30 and "deployments.generation" in graph
    assert "deployments.stream_resumer" in graph["deployments.generation"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
