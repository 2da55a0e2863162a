"""benchmarks.slo_classes (the trace it replays and a whole tiny run) and benchmarks.warmup."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.slo_classes import main, make_trace


def args(**kw: object):  # noqa: ANN201
    from types import SimpleNamespace

    base = {
        "seed": 0,
        "rate": 50.0,
        "duration": 2.0,
        "tight_share": 0.25,
        "tight_prompt": 8,
        "loose_prompt": 32,
        "tight_output": 2,
        "loose_output": 6,
        "deadline_ms": 500.0,
    }
    return SimpleNamespace(**{**base, **kw})


def test_trace_is_reproducible_and_splits_the_classes() -> None:
    trace = make_trace(args())
    assert trace == make_trace(args())
    assert 60 < len(trace) < 140  # Poisson, 50/s for 2 s
    assert all(0 < a.at_s < 2.0 for a in trace)
    assert [a.at_s for a in trace] == sorted(a.at_s for a in trace)
    tight = [a for a in trace if a.cls == "tight"]
    assert 0.1 < len(tight) / len(trace) < 0.4
    assert all(len(a.prompt) == 8 and a.max_tokens == 2 and a.deadline_ms == 500 for a in tight)
    loose = [a for a in trace if a.cls == "loose"]
    assert all(len(a.prompt) == 32 and a.deadline_ms is None for a in loose)
    assert make_trace(args(seed=1)) != trace


def test_a_tiny_run_serves_every_request_under_both_policies(tiny_llama: Path, capsys) -> None:
    main(
        [
            "--model", str(tiny_llama), "--dtype", "float32", "--rate", "40",
            "--duration", "0.5", "--tight-prompt", "8", "--loose-prompt", "24",
            "--tight-output", "2", "--loose-output", "4", "--max-num-seqs", "4",
            "--tight-share", "0.5",
            "--engine-opt", "num_kv_blocks=128", "--json",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    results = json.loads(out.strip().splitlines()[-1])
    assert [r["policy"] for r in results] == ["fcfs", "deadline"]
    trace = make_trace(
        args(rate=40.0, duration=0.5, tight_prompt=8, loose_prompt=24, tight_share=0.5)
    )
    n = len(trace)
    assert any(a.cls == "tight" for a in trace)
    for r in results:
        assert sum(c["requests"] for c in r["classes"].values()) == n
        assert r["throughput_tok_s"] > 0
    # Every request ran to its max_tokens: the same output under both policies.
    assert results[0]["output_tokens"] == results[1]["output_tokens"]
    assert "tight TTFT p99" in out


def test_warmup_benchmark_times_the_first_requests(tiny_llama: Path, capsys) -> None:
    from benchmarks.warmup import main as warmup_main

    warmup_main(["--model", str(tiny_llama), "--dtype", "float32", "--requests", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("without warm-up") and "warm-up       0 ms" in lines[0]
    assert lines[2].startswith("with warm-up") and "warm-up       0 ms" not in lines[2]
    assert all(len(line.split(":")[1].split()) == 3 for line in (lines[1], lines[3]))
