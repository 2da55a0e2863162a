"""benchmarks.gil_convoy runs end to end on a tiny model and prints one line per setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import gil_convoy


def test_prints_a_line_per_interval_with_and_without_the_thread(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gil_convoy.main(
        ["--model", str(tiny_llama), "--dtype", "float32", "--intervals", "5,0.2", "--rounds", "1"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("none", "5.0"),
        ("none", "0.2"),
        ("spinning", "5.0"),
        ("spinning", "0.2"),
    ]
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
