"""The synthetic trace generator: Mooncake's format, a pure function of its seed, shared prefixes,
and traces that the simulator and the live replay read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import make_trace, simulate
from benchmarks.make_trace import BLOCK_TOKENS, generate, trace_stats
from benchmarks.sim.trace import distinct_blocks, load_trace
from benchmarks.workloads import trace_requests

KEYS = ["timestamp", "input_length", "output_length", "hash_ids"]


def _cli(tmp_path: Path, *args: str) -> tuple[Path, list[dict]]:
    out = tmp_path / "trace.jsonl"
    assert make_trace.main(["--out", str(out), *args]) == 0
    return out, [json.loads(line) for line in out.read_text().splitlines()]


def test_mooncake_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, records = _cli(tmp_path, "--num-requests", "500", "--seed", "3")
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert len(records) == 500
    # The keys in Mooncake's order, integers only, and the file written the way its traces are.
    assert all(list(r) == KEYS for r in records)
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in records)
    assert records[0]["timestamp"] == 0
    times = [r["timestamp"] for r in records]
    assert times == sorted(times)
    seen = -1
    for r in records:
        ids = r["hash_ids"]
        assert all(isinstance(v, int) for v in [r["input_length"], r["output_length"], *ids])
        assert r["output_length"] >= 1
        # One id per 512-token block, the last one possibly partial.
        assert (len(ids) - 1) * BLOCK_TOKENS < r["input_length"] <= len(ids) * BLOCK_TOKENS
        assert len(set(ids)) == len(ids)
        # New ids are handed out in increasing order, as in the Mooncake traces.
        new = [h for h in ids if h > seen]
        assert new == list(range(seen + 1, seen + 1 + len(new)))
        seen = max(seen, *ids)


def test_a_pure_function_of_the_seed(tmp_path: Path) -> None:
    assert generate(300, seed=5) == generate(300, seed=5)
    assert generate(300, seed=5) != generate(300, seed=6)
    first, _ = _cli(tmp_path / "1", "--num-requests", "200", "--seed", "9")
    second, _ = _cli(tmp_path / "2", "--num-requests", "200", "--seed", "9")
    assert first.read_bytes() == second.read_bytes()


def test_shared_prefixes_and_long_tails() -> None:
    records = generate(2000, seed=0)
    stats = trace_stats(records)
    # As in the Mooncake synthetic trace: ~45% of requests reuse an earlier prefix, ~2/3 of the
    # blocks an infinite cache sees are hits.
    assert 0.35 < stats["sharing_fraction"] < 0.55
    assert 0.5 < stats["infinite_cache_hit_ratio"] < 0.8
    # Shared prefixes are chains: a request reusing an earlier one's first block reuses a run of
    # its blocks, not single blocks.
    first_seen: dict[int, list[int]] = {}
    shared_runs = []
    for r in records:
        ids = r["hash_ids"]
        if ids[0] in first_seen:
            earlier = first_seen[ids[0]]
            pairs = zip(ids, earlier, strict=False)
            same = min(len(ids), len(earlier))
            shared_runs.append(next((i for i, (a, b) in enumerate(pairs) if a != b), same))
        first_seen.setdefault(ids[0], ids)
    assert len(shared_runs) > 500
    assert sorted(shared_runs)[len(shared_runs) // 2] >= 5
    # Long-tailed lengths: short prompts and prompts of tens of thousands of tokens.
    inputs = sorted(r["input_length"] for r in records)
    assert inputs[len(inputs) // 10] < 512 and inputs[-len(inputs) // 100] > 40_000
    outputs = sorted(r["output_length"] for r in records)
    assert outputs[len(outputs) // 2] < 150 < outputs[-len(outputs) // 20]


def test_rate_and_replicas(tmp_path: Path) -> None:
    _, records = _cli(tmp_path, "--num-requests", "2000", "--rate", "10")
    assert trace_stats(records)["rate"] == pytest.approx(10, rel=0.1)
    _, records = _cli(tmp_path, "--num-requests", "2000", "--replicas", "32")
    assert trace_stats(records)["rate"] == pytest.approx(32 * make_trace.RATE_PER_REPLICA, rel=0.1)
    with pytest.raises(SystemExit):
        make_trace.main(["--rate", "1", "--replicas", "2", "--out", str(tmp_path / "x")])


def test_default_out_is_in_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    assert make_trace.main(["--num-requests", "10"]) == 0
    assert len((tmp_path / "traces" / "synthetic_trace.jsonl").read_text().splitlines()) == 10


def test_simulator_and_replay_read_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, records = _cli(tmp_path, "--num-requests", "300", "--replicas", "2")
    specs = load_trace(out, block_tokens=16)
    assert len(specs) == 300
    # Shared hash ids became shared block hashes.
    assert distinct_blocks(specs) < sum(len(s.block_hashes) for s in specs)
    doc = simulate.main(
        ["--trace", str(out), "--replicas", "2", "--block-tokens", "16", "--quiet",
         "--policy", "prefix_aware,round_robin", "--capacity-fraction", "0.2"]
    )  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_requests"] == 300
    assert all(r["completed"] == 300 for r in doc["runs"])
    assert doc["ideal_infinite_hit_ratio"] > 0.2
    aware, round_robin = doc["runs"]
    assert aware["hit_ratio"] > round_robin["hit_ratio"]
    # The live replay turns equal hash ids into equal tokens.
    requests = trace_requests(out, block_tokens=8, limit=50)
    by_first: dict[int, list[int]] = {}
    for record, request in zip(records, requests, strict=False):
        head = request.prompt_token_ids[:8]
        assert by_first.setdefault(record["hash_ids"][0], head) == head
