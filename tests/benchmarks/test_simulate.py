"""The routing simulator: known answers on small traces, the ideal cache, the live hash notion,
the calibration fit and the command line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import simulate
from benchmarks.calibrate import StepSample, fit_samples, fit_step_cost, prefill_pairs
from benchmarks.sim.cluster import Cluster, ClusterConfig, ClusterRun
from benchmarks.sim.ideal import ideal_hit_ratio, ttft_floors_s
from benchmarks.sim.metrics import summarize_run
from benchmarks.sim.profile import DEFAULT_PROFILE, Profile, StepCost
from benchmarks.sim.trace import SimRequestSpec, distinct_blocks, load_trace
from benchmarks.workloads import trace_requests
from engine.block_hash import compute_block_hashes, hash_root

BLOCK = 16  # tokens per trace block in these tests
# A fast engine: 1 ms per step plus 10 us per prompt token, 0.2 ms per decode.
PROFILE = Profile(
    "test", StepCost(base_s=0.001, prefill_token_s=1e-5, decode_seq_s=2e-4), transfer_block_s=1e-4
)


def _write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _record(t_ms: float, hash_ids: list[int], extra_tokens: int = 100, out: int = 4) -> dict:
    """A record whose prompt is ``hash_ids`` full 512-token blocks plus a partial last one, so
    that scaled to 16-token blocks every full block can be hit (the last token is recomputed)."""
    return {
        "timestamp": t_ms,
        "input_length": (len(hash_ids) - 1) * 512 + extra_tokens,
        "output_length": out,
        "hash_ids": hash_ids,
    }


def _run(
    specs: list[SimRequestSpec], replicas: int, policy: str = "prefix_aware", **kw: object
) -> ClusterRun:
    config = ClusterConfig(
        replicas=replicas,
        capacity_blocks=int(kw.pop("capacity_blocks", 1000)),  # type: ignore[arg-type]
        policy=policy,
        block_tokens=BLOCK,
        **kw,  # type: ignore[arg-type]
    )
    return Cluster(PROFILE, config).run(specs)


def _hit(run: ClusterRun) -> float:
    return summarize_run(run)["hit_ratio"]


def test_ttft_floor_is_what_an_idle_replica_gives_each_request_alone(tmp_path: Path) -> None:
    # Requests 10 s apart on one replica never share a step, so each one's simulated time to
    # first token is its floor: prefill of what the cache misses, in budget-sized chunks.
    records = [
        _record(10_000 * 0, [*range(40)]),  # 40 blocks: 2 chunks of the 512-token budget
        _record(10_000 * 1, [*range(40), 90]),  # the same 40 blocks hit, then a new one
        _record(10_000 * 2, [7, 8]),  # cold
    ]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    profile = Profile(
        "test",
        StepCost(base_s=0.001, prefill_token_s=1e-5, prefill_pair_s=1e-8, decode_seq_s=2e-4),
        max_num_batched_tokens=512,
    )
    config = ClusterConfig(replicas=1, capacity_blocks=1000, block_tokens=BLOCK)
    run = Cluster(profile, config).run(specs)
    simulated = [r.first_token_time - r.arrival_time for r in run.requests]
    floors = ttft_floors_s(specs, 1000, BLOCK, profile)
    assert floors == pytest.approx(simulated, rel=1e-9)
    # By hand: the first request's prompt takes a 512-token chunk, then the rest.
    rest = specs[0].prompt_len - 512
    assert 0 < rest < 512
    c = profile.step
    first = c.step_s(512, 512 * 256.5, 0, 0) + c.step_s(rest, rest * (512 + (rest + 1) / 2), 0, 0)
    assert floors[0] == pytest.approx(first)
    assert floors[1] < floors[0] / 5  # the second request prefills only its new block


def _recorded_reports(cluster: Cluster) -> list[dict]:
    reports: list[dict] = []
    apply = cluster.policy.apply_report

    def record(replica_id: str, stats: dict, now: float) -> bool:
        reports.append(dict(stats, applied_at=now))
        return apply(replica_id, stats, now)

    cluster.policy.apply_report = record  # type: ignore[method-assign]
    return reports


@pytest.mark.parametrize(
    ("prefill_token_s", "reported_at"), [(2e-3, 0.001 + 640 * 2e-3), (5e-3, 4.0)]
)
def test_a_replica_reports_between_steps(
    tmp_path: Path, prefill_token_s: float, reported_at: float
) -> None:
    # One 640-token prompt at t=0 prefills in one step; the router asks for a report at 1 s.
    # A live replica takes the snapshot after the step in progress: at its end if that comes
    # within the 2 s timeout (2e-3 s per token: 1.281 s), with the prefill done; otherwise
    # (3.2 s) the snapshot is dropped, and the first report is the idle replica's at 4 s.
    specs = load_trace(
        _write_trace(tmp_path / "t.jsonl", [_record(0, [*range(41)], 0)]), block_tokens=BLOCK
    )
    assert specs[0].prompt_len == 640
    profile = Profile("slow", StepCost(base_s=0.001, prefill_token_s=prefill_token_s))
    cluster = Cluster(profile, ClusterConfig(replicas=1, capacity_blocks=1000, block_tokens=BLOCK))
    reports = _recorded_reports(cluster)
    run = cluster.run(specs)
    assert run.requests[0].first_token_time == pytest.approx(0.001 + 640 * prefill_token_s)
    assert reports[0]["reported_at"] == pytest.approx(reported_at)
    assert reports[0]["applied_at"] == reports[0]["reported_at"]
    assert reports[0]["num_pending_prefill_tokens"] == 0


def test_one_shared_prefix_hits_all_but_the_first(tmp_path: Path) -> None:
    n = 20
    # 10 shared full blocks, then a partial block unique to each request (id 100 + i).
    records = [_record(1000 * i, [*range(10), 100 + i]) for i in range(n)]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    prompt = specs[0].prompt_len
    assert prompt == 10 * BLOCK + 4 and len(specs[0].block_hashes) == 10
    expected = (n - 1) * 10 * BLOCK / (n * prompt)
    run = _run(specs, replicas=4)
    assert _hit(run) == pytest.approx(expected)
    assert ideal_hit_ratio(specs, 4 * 1000, BLOCK) == pytest.approx(expected)
    # Only the prefix-aware router keeps them together.
    assert _hit(_run(specs, replicas=4, policy="round_robin")) == pytest.approx(
        (n - 4) * 10 * BLOCK / (n * prompt)
    )
    assert _hit(_run(specs, replicas=4, policy="power_of_two")) < expected


def test_no_sharing_no_hits(tmp_path: Path) -> None:
    records = [_record(100 * i, [10 * i + k for k in range(5)]) for i in range(30)]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    for policy in simulate.POLICY_NAMES:
        run = _run(specs, replicas=3, policy=policy)
        assert _hit(run) == 0.0
        assert len([r for r in run.requests if r.finish_time is not None]) == 30
    assert ideal_hit_ratio(specs, None, BLOCK) == 0.0


def test_capacity_below_the_working_set_lowers_hits(tmp_path: Path) -> None:
    # 8 conversations of 20 blocks each, revisited in turn 5 times: a working set of 160 blocks.
    records = [
        _record(200 * (8 * rnd + c), [1000 * c + k for k in range(20)] + [99_999 - 8 * rnd - c])
        for rnd in range(5)
        for c in range(8)
    ]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    assert distinct_blocks(specs) == 160
    big = _hit(_run(specs, replicas=1, capacity_blocks=400))
    small = _hit(_run(specs, replicas=1, capacity_blocks=60))
    assert big == pytest.approx(4 / 5 * 20 * BLOCK / specs[0].prompt_len)
    assert small < big / 2
    # LRU over a cyclic scan larger than the cache: the ideal cache misses everything too.
    assert ideal_hit_ratio(specs, 60, BLOCK) == 0.0
    assert ideal_hit_ratio(specs, 160, BLOCK) == pytest.approx(big)


def test_ideal_cache_on_a_hand_made_trace() -> None:
    def spec(i: int, blocks: list[int]) -> SimRequestSpec:
        return SimRequestSpec(i, float(i), len(blocks) * BLOCK + 1, 1, tuple(blocks))

    specs = [spec(0, [1, 2, 3]), spec(1, [1, 2, 4]), spec(2, [5]), spec(3, [1, 2, 3])]
    total = sum(s.prompt_len for s in specs)
    # Unbounded: B hits 1,2; D hits 1,2,3.
    assert ideal_hit_ratio(specs, None, BLOCK) == pytest.approx(5 * BLOCK / total)
    # 3 blocks, LRU first: after A [3,2,1]; B hits 2 -> [3,4,2,1] -> evict 3 -> [4,2,1];
    # C -> [4,2,1,5] -> evict 4 -> [2,1,5]; D hits 1,2 (3 is gone).
    assert ideal_hit_ratio(specs, 3, BLOCK) == pytest.approx(4 * BLOCK / total)
    # The engine never serves the last prompt token from cache: a prompt of exactly 3 full blocks
    # can hit at most 2 of them.
    exact = [SimRequestSpec(i, float(i), 3 * BLOCK, 1, (1, 2, 3)) for i in range(2)]
    assert ideal_hit_ratio(exact, None, BLOCK) == pytest.approx(2 * BLOCK / (6 * BLOCK))


def test_kv_sharing_never_lowers_the_hit_ratio(tmp_path: Path) -> None:
    rng = random.Random(5)
    # 6 system prompts of 12 blocks shared by many requests with their own 3-block questions.
    records = []
    for i in range(90):
        group = rng.randrange(6)
        records.append(
            _record(
                150 * i,
                [1000 * group + k for k in range(12)] + [50_000 + 4 * i + q for q in range(4)],
            )
        )
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    for policy in simulate.POLICY_NAMES:
        plain = _hit(_run(specs, replicas=4, policy=policy))
        shared = _run(specs, replicas=4, policy=policy, kv_sharing=True)
        assert _hit(shared) >= plain, policy
        if policy == "round_robin":
            # Round robin scatters every group: the directory supplies the prefixes.
            assert _hit(shared) > plain
            assert summarize_run(shared)["remote_hit_ratio"] > 0


def test_round_robin_spreads_evenly_through_the_real_policy(tmp_path: Path) -> None:
    records = [_record(50 * i, [7, 8, 9, 100 + i]) for i in range(40)]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    run = _run(specs, replicas=4, policy="round_robin")
    assert [r.num_routed for r in run.replicas] == [10, 10, 10, 10]
    assert run.policy.counters == {"round_robin": 40}
    # The prefix-aware policy keeps the shared prefix on one replica and says so.
    aware = _run(specs, replicas=4, stats_period_s=0.2)
    assert max(r.num_routed for r in aware.replicas) == 40
    assert aware.policy.counters["evict_oldest"] == 1  # only the first request had no match
    assert aware.policy.counters["prefix"] == 39
    # Reports reached the policy: the serving replica's view holds the shared blocks.
    serving = max(aware.replicas, key=lambda r: r.num_routed)
    view = aware.policy.view(serving.replica_id)
    assert set(specs[0].block_hashes) <= view.cached


def test_simulated_prefixes_equal_the_live_ones(tmp_path: Path) -> None:
    rng = random.Random(3)
    records = []
    for i in range(40):
        # Conversations extend earlier prompts (prefix-chained ids), sometimes with a short tail.
        base = rng.randrange(5)
        ids = [base * 100 + k for k in range(rng.randrange(1, 6))] + [1000 + i]
        records.append(
            {
                "timestamp": 10 * i,
                "input_length": len(ids) * 512 - rng.randrange(0, 400),
                "output_length": 3,
                "hash_ids": ids,
            }  # fmt: skip
        )
    path = _write_trace(tmp_path / "t.jsonl", records)
    for block_tokens in (4, 16):
        live = trace_requests(path, block_tokens=block_tokens, time_scale=0.5)
        sim = load_trace(path, block_tokens=block_tokens, time_scale=0.5)
        to_sim: dict[int, int] = {}
        to_live: dict[int, int] = {}
        occurrences = 0
        for lr, sr in zip(live, sim, strict=True):
            assert (lr.prompt_len, lr.output_len) == (sr.prompt_len, sr.output_len)
            assert lr.arrival_time == pytest.approx(sr.arrival)
            hashes = compute_block_hashes(lr.prompt_token_ids, block_tokens, hash_root("smollm2"))
            assert len(hashes) == len(sr.block_hashes)
            occurrences += len(hashes)
            for h_live, h_sim in zip(hashes, sr.block_hashes, strict=True):
                # A bijection: equal live hashes exactly when equal simulated hashes.
                assert to_sim.setdefault(h_live, h_sim) == h_sim
                assert to_live.setdefault(h_sim, h_live) == h_live
        # Blocks were shared, and distinct ones stayed apart.
        assert 20 < len(to_sim) < occurrences


def test_trace_offset_slices_alike(tmp_path: Path) -> None:
    records = [_record(1000 + 250 * i, [i, 50 + i]) for i in range(10)]
    path = _write_trace(tmp_path / "t.jsonl", records)
    live = trace_requests(path, block_tokens=BLOCK, offset=4, limit=3)
    sim = load_trace(path, block_tokens=BLOCK, offset=4, limit=3)
    assert [r.hash_ids for r in live] == [(4, 54), (5, 55), (6, 56)]
    assert [r.arrival_time for r in live] == [0.0, 0.25, 0.5]
    assert [s.arrival for s in sim] == [0.0, 0.25, 0.5]


def test_busy_replicas_queue_and_preempt_like_the_engine(tmp_path: Path) -> None:
    # 30 long requests at once on one replica of 40 blocks: admission must wait for blocks, and
    # every request still finishes with exactly its output length.
    records = [_record(0, [100 * i + k for k in range(4)], out=40) for i in range(30)]
    specs = load_trace(_write_trace(tmp_path / "t.jsonl", records), block_tokens=BLOCK)
    run = _run(specs, replicas=1, capacity_blocks=40)
    done = [r for r in run.requests if r.finish_time is not None]
    assert len(done) == 30
    assert all(r.num_output_tokens == 40 for r in done)
    assert all(r.first_token_time is not None and r.first_token_time <= r.finish_time for r in done)
    ttfts = sorted(r.first_token_time for r in done)
    assert ttfts[-1] > 10 * ttfts[0]  # later requests waited for earlier ones
    assert run.replicas[0].kv.pool.num_free_blocks == 40  # everything freed at the end


def test_calibration_fit_recovers_a_known_model() -> None:
    truth = StepCost(0.004, 2e-4, 3e-8, 1.5e-3, 2e-7)
    rng = random.Random(0)
    samples = []
    for n in (16, 64, 256, 1024, 2048):
        for ctx in (0, 1024, 4096):
            pairs = prefill_pairs(n, ctx)
            t = truth.step_s(n, pairs, 0, 0) * rng.uniform(0.98, 1.02)
            samples.append(StepSample("prefill", n, pairs, 0, 0, t))
    for b in (1, 4, 16, 64):
        for ctx in (32, 512, 2048):
            t = truth.step_s(0, 0.0, b, b * ctx) * rng.uniform(0.98, 1.02)
            samples.append(StepSample("decode", 0, 0.0, b, b * ctx, t))
    fit = fit_step_cost(samples)
    for got, want in zip(fit.as_vector(), truth.as_vector(), strict=True):
        assert got == pytest.approx(want, rel=0.15)
    # A feature that only adds noise is pinned at zero rather than fitted negative.
    flat = [StepSample("decode", 0, 0.0, b, 0, 0.01) for b in (1, 2, 4, 8)]
    assert all(v >= 0 for v in fit_step_cost(flat).as_vector())


@pytest.mark.parametrize(
    "path", sorted(DEFAULT_PROFILE.parent.glob("*.json")), ids=lambda p: p.stem
)
def test_a_shipped_profile_is_the_fit_of_its_own_samples(path: Path) -> None:
    """Each profile under benchmarks/profiles carries the samples it was fitted on: fitting them
    again gives its coefficients and recorded fit quality, so none was edited by hand."""
    profile = Profile.load(path)
    samples = [StepSample(**s) for s in profile.meta["samples"]]
    fitted, quality = fit_samples(samples)
    assert quality == {k: profile.meta[k] for k in quality}
    for got, want in zip(fitted.as_vector(), profile.step.as_vector(), strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert profile.name == path.stem


def test_command_line_sweep_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    records = [_record(100 * i, [i % 5, 10 + i % 5, 1000 + i]) for i in range(30)]
    trace = _write_trace(tmp_path / "t.jsonl", records)
    profile = tmp_path / "p.json"
    PROFILE.save(profile)
    plot = tmp_path / "sweep.png"
    doc = simulate.main(
        [
            "--trace",
            str(trace),
            "--sweep",
            "1,2",
            "--policy",
            "prefix_aware,round_robin",
            "--profile",
            str(profile),
            "--capacity-fraction",
            "0.5",
            "--plot",
            str(plot),
            "--router-config",
            '{"load_cost_per_request": 2}',
            "--quiet",
        ]  # fmt: skip
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(doc))
    assert doc["capacity_blocks"] == round(0.5 * doc["distinct_blocks"])
    assert [(r["replicas"], r["policy"]) for r in doc["runs"]] == [
        (1, "prefix_aware"), (1, "round_robin"), (2, "prefix_aware"), (2, "round_robin")
    ]  # fmt: skip
    assert all(r["completed"] == 30 for r in doc["runs"])
    assert plot.stat().st_size > 10_000
    with pytest.raises(ValueError, match="unknown router option"):
        simulate.main(["--trace", str(trace), "--profile", str(profile),
                       "--router-config", '{"load_cost": 2}', "--quiet"])  # fmt: skip


def test_live_json_sets_the_same_scaling(tmp_path: Path) -> None:
    records = [_record(100 * i, [i % 3, 10 + i % 3, 1000 + i], out=50) for i in range(20)]
    trace = _write_trace(tmp_path / "t.jsonl", records)
    profile = tmp_path / "p.json"
    PROFILE.save(profile)
    live = tmp_path / "live.json"
    config = {
        "workload": "trace",
        "trace_path": str(trace),
        "trace_block_tokens": 8,
        "trace_output_scale": 1.0,
        "max_output_len": 5,
        "max_input_len": None,
        "time_scale": 0.5,
        "trace_limit": 12,
        "trace_offset": 3,
        "concurrency": None,
        "request_rate": None,
        "ignore_eos": True,
    }
    live.write_text(json.dumps({"config": config, "summary": {"prefix_cache_hit_ratio": 0.4}}))
    doc = simulate.main(
        ["--live-json", str(live), "--replicas", "2", "--profile", str(profile), "--quiet"]
    )
    assert doc["num_requests"] == 12 and doc["block_tokens"] == 8 and doc["time_scale"] == 0.5
    (run,) = doc["runs"]
    assert run["output_tokens"] == 12 * 5
    assert doc["live"]["hit_ratio"] == 0.4
    assert run["hit_ratio_vs_live"] == pytest.approx(run["hit_ratio"] / 0.4)
    # A slower machine: every step takes twice as long, so (with this light load) TTFT doubles.
    common = ["--live-json", str(live), "--replicas", "2", "--profile", str(profile), "--quiet"]
    slow = simulate.main([*common, "--slowdown", "2"])
    fast = simulate.main(common)
    assert slow["runs"][0]["ttft_ms"]["p50"] == pytest.approx(2 * fast["runs"][0]["ttft_ms"]["p50"])
