"""Replay a Mooncake-format trace against N simulated engine replicas, routed by ``router/``.

    python -m benchmarks.simulate --trace /path/to/trace.jsonl --replicas 16 \\
        --policy prefix_aware,power_of_two --capacity-fraction 0.05 --plot out.png

``--disaggregated 0,1/4,4`` also runs each configuration with prefill/decode disaggregation:
0 is colocated, ``a/b`` that fraction of the replicas (rounded, at least one of each kind) as
prefill replicas, an integer that many (see benchmarks/sim/disagg.py).

Each run prints a short summary to stderr; the last line of stdout is one JSON document with every
run (``runs``), the ideal single-cache hit ratios and the configuration. See docs/routing.md
("Simulating routing at scale") for the model and its calibration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.sim.cluster import ClusterConfig
from benchmarks.sim.disagg import DisaggregatedRun, make_cluster, summarize_disaggregation
from benchmarks.sim.ideal import ideal_hit_ratio, ttft_floors_s
from benchmarks.sim.metrics import distribution_ms, per_replica, summarize_run, ttfts
from benchmarks.sim.profile import DEFAULT_PROFILE, Profile
from benchmarks.sim.ray_policies import PORTS
from benchmarks.sim.trace import SimRequestSpec, distinct_blocks, load_trace

POLICY_NAMES = ("prefix_aware", "power_of_two", "round_robin", *PORTS)


def run_one(
    specs: Sequence[SimRequestSpec], profile: Profile, config: ClusterConfig, prefill: int = 0
) -> dict[str, Any]:
    """Simulate one cluster (disaggregated with ``prefill`` > 0 prefill replicas); the summary
    plus its configuration and private plot series."""
    run = make_cluster(profile, config, prefill).run(specs)
    summary = summarize_run(run)
    # Only with nodes modelled, so that the default output stays as it was.
    topology: dict[str, Any] = {}
    if config.replicas_per_node is not None:
        topology["replicas_per_node"] = config.replicas_per_node
        if run.directory is not None:
            topology["cross_node_fetched_blocks"] = run.directory.imported_cross_node_blocks
    extra: dict[str, Any] = {}
    if isinstance(run, DisaggregatedRun):
        extra["prefill_replicas"] = prefill
        extra["disaggregation"] = summarize_disaggregation(run, summary["makespan_s"])
    return {
        "policy": config.policy,
        "replicas": config.replicas,
        "kv_sharing": config.kv_sharing,
        "capacity_blocks": config.capacity_blocks,
        **topology,
        **extra,
        **summary,
        "_ttfts": ttfts(run),
        "_per_replica": per_replica(run),
    }


def _prefill_counts(text: str) -> list[str]:
    """``--disaggregated``: checked here, resolved per cluster size by ``prefill_replicas``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    for item in items:
        try:
            _prefill_value(item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return items


def _prefill_value(item: str) -> int | float:
    """One ``--disaggregated`` item: a count >= 0, or a fraction ``a/b`` in (0, 1)."""
    if "/" in item:
        num, _, den = item.partition("/")
        fraction = int(num) / int(den)
        if not 0 < fraction < 1:
            raise ValueError(f"--disaggregated: a fraction must be in (0, 1), got {item!r}")
        return fraction
    count = int(item)
    if count < 0:
        raise ValueError(f"--disaggregated: a count must be >= 0, got {item!r}")
    return count


def prefill_replicas(item: str, replicas: int) -> int:
    """Prefill replicas out of ``replicas`` for one ``--disaggregated`` item: 0 (colocated), a
    count (below ``replicas``), or a fraction rounded and kept within [1, replicas - 1]."""
    value = _prefill_value(item)
    if isinstance(value, float):
        return min(max(round(value * replicas), 1), replicas - 1)
    if value and value >= replicas:
        raise ValueError(
            f"--disaggregated: {value} prefill replicas leave no decode replica of {replicas}"
        )
    return value


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if name not in POLICY_NAMES:
            raise argparse.ArgumentTypeError(f"unknown policy {name!r}; one of {POLICY_NAMES}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.simulate",
        description="Discrete-event simulation of prefix-aware routing over N engine replicas.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t = p.add_argument_group("trace (scaled exactly as benchmarks.serve --workload trace)")
    t.add_argument("--trace", type=Path, default=None, help="Mooncake-format JSONL trace")
    t.add_argument("--live-json", type=Path, default=None,
                   help="a live `benchmarks.serve --workload trace --output-json` result: replay "
                   "its trace with its scaling flags and report both hit ratios")  # fmt: skip
    t.add_argument("--block-tokens", type=int, default=16,
                   help="tokens per trace hash id; also the simulated KV block size")  # fmt: skip
    t.add_argument("--time-scale", type=float, default=1.0,
                   help="arrival = timestamp * time-scale (0.5 = twice the rate)")  # fmt: skip
    t.add_argument("--output-scale", type=float, default=1.0)
    t.add_argument("--max-output-len", type=int, default=128, help="output cap; 0 = none")
    t.add_argument("--max-input-len", type=int, default=None, help="prompt length cap")
    t.add_argument("--trace-limit", type=int, default=None, help="first N records")
    t.add_argument("--trace-offset", type=int, default=0,
                   help="skip the first N records (arrivals start at the next one)")  # fmt: skip

    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=8)
    c.add_argument("--sweep", type=_int_list, default=None,
                   help="comma-separated replica counts, e.g. 8,32,128 (overrides --replicas)")  # fmt: skip
    c.add_argument("--policy", type=_policies, default=["prefix_aware"],
                   help="routing policy, or a comma-separated list to compare")  # fmt: skip
    c.add_argument("--router-config", type=json.loads, default={},
                   help='RouterConfig fields as JSON, e.g. \'{"load_cost_per_request": 2}\' (for the Ray ports: fields of their config in benchmarks/sim/ray_policies.py)')  # fmt: skip
    c.add_argument("--stats-period", type=float, default=1.0,
                   help="seconds between replica reports to the router")  # fmt: skip
    cap = c.add_mutually_exclusive_group()
    cap.add_argument("--capacity-blocks", type=int, default=None,
                     help="KV blocks per replica; default: the profile's KV capacity")  # fmt: skip
    cap.add_argument("--capacity-fraction", type=float, default=None,
                     help="KV blocks per replica as a fraction of the trace's distinct blocks")  # fmt: skip
    c.add_argument("--kv-sharing", action="store_true", help="a shared KV directory")
    c.add_argument("--both-sharing", action="store_true",
                   help="run every configuration with and without KV sharing")  # fmt: skip
    c.add_argument("--directory-capacity-blocks", type=int, default=None,
                   help="default: replicas x capacity (the cluster's total KV)")  # fmt: skip
    c.add_argument("--kv-min-blocks", type=int, default=4,
                   help="fewest blocks worth publishing or importing (live default 4)")  # fmt: skip
    c.add_argument("--no-directory-hint", action="store_true",
                   help="do not tell the router which blocks the directory holds")  # fmt: skip
    c.add_argument("--max-ongoing-requests", type=int, default=256)
    c.add_argument("--replicas-per-node", type=int, default=None,
                   help="replicas per Ray node (default: all on one node, no node ids)")  # fmt: skip
    c.add_argument("--cross-node-transfer-block-s", type=float, default=None,
                   help="seconds to import one block published on another node (default: the "
                   "profile's, else its same-node time plus the measured extra)")  # fmt: skip
    c.add_argument("--disaggregated", type=_prefill_counts, default=None, metavar="P[,P...]",
                   help="prefill replicas out of --replicas for prefill/decode disaggregation: "
                   "a count or a fraction like 1/4; a list compares them, 0 = colocated")  # fmt: skip
    c.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="cost profile JSON")
    c.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="override the profile's token budget")  # fmt: skip
    c.add_argument("--max-num-seqs", type=int, default=None)
    c.add_argument("--slowdown", type=float, default=1.0,
                   help="multiply every step and transfer time (a machine busier than when the "
                   "profile was measured)")  # fmt: skip
    c.add_argument("--seed", type=int, default=0)

    o = p.add_argument_group("output")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG figure here")
    o.add_argument("--output-json", type=Path, default=None, help="also write the JSON here")
    o.add_argument("--quiet", action="store_true", help="no per-run lines on stderr")
    return p


def _profile(args: argparse.Namespace) -> Profile:
    profile = Profile.load(args.profile)
    changes: dict[str, Any] = {}
    if args.max_num_batched_tokens is not None:
        changes["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs is not None:
        changes["max_num_seqs"] = args.max_num_seqs
    if args.slowdown != 1.0:
        changes["step"] = {k: v * args.slowdown for k, v in profile.step.__dict__.items()}
        changes["transfer_base_s"] = profile.transfer_base_s * args.slowdown
        changes["transfer_block_s"] = profile.transfer_block_s * args.slowdown
        if profile.transfer_cross_node_block_s is not None:
            changes["transfer_cross_node_block_s"] = (
                profile.transfer_cross_node_block_s * args.slowdown
            )
    if args.cross_node_transfer_block_s is not None:
        changes["transfer_cross_node_block_s"] = args.cross_node_transfer_block_s
    if changes:
        profile = Profile.from_json({**profile.to_json(), **changes})
    return profile


# benchmarks.serve option -> this command's option, for --live-json.
_LIVE_TRACE_FLAGS = {
    "trace_path": "trace",
    "trace_block_tokens": "block_tokens",
    "trace_output_scale": "output_scale",
    "max_output_len": "max_output_len",
    "max_input_len": "max_input_len",
    "time_scale": "time_scale",
    "trace_limit": "trace_limit",
    "trace_offset": "trace_offset",
}


def apply_live_config(args: argparse.Namespace) -> dict[str, Any]:
    """Take the trace and its scaling from a live run's JSON (``benchmarks.serve
    --output-json``); returns the live summary. Warns when the live run did not follow the trace's
    own timing or exact output lengths, which the simulator assumes."""
    document = json.loads(args.live_json.read_text())
    config, summary = document["config"], document["summary"]
    if config.get("workload") != "trace":
        raise SystemExit(f"{args.live_json}: not a trace workload run")
    for live_key, own_key in _LIVE_TRACE_FLAGS.items():
        if live_key in config:
            value = config[live_key]
            setattr(args, own_key, Path(value) if own_key == "trace" else value)
    if config.get("concurrency") or config.get("request_rate") is not None:
        print("warning: the live run limited concurrency or set its own request rate; the "
              "simulator follows the trace's timestamps", file=sys.stderr)  # fmt: skip
    if not config.get("ignore_eos"):
        print("warning: the live run did not use --ignore-eos: output lengths may differ",
              file=sys.stderr)  # fmt: skip
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    live = apply_live_config(args) if args.live_json is not None else None
    if args.trace is None:
        raise SystemExit("--trace (or --live-json) is required")
    profile = _profile(args)
    specs = load_trace(
        args.trace,
        block_tokens=args.block_tokens,
        output_scale=args.output_scale,
        max_output_len=args.max_output_len or None,
        time_scale=args.time_scale,
        max_input_len=args.max_input_len,
        limit=args.trace_limit,
        offset=args.trace_offset,
    )
    if not specs:
        raise SystemExit("the trace is empty")
    distinct = distinct_blocks(specs)
    if args.capacity_blocks is not None:
        capacity = args.capacity_blocks
    elif args.capacity_fraction is not None:
        capacity = max(1, round(args.capacity_fraction * distinct))
    else:
        capacity = max(1, profile.kv_capacity_tokens // args.block_tokens)
    load_s = time.perf_counter() - started
    sizes = args.sweep or [args.replicas]
    sharing_modes = [False, True] if args.both_sharing else [args.kv_sharing]
    ideal_cache: dict[int, float] = {}
    floor_cache: dict[int, dict[str, float | None]] = {}
    runs: list[dict[str, Any]] = []
    for n in sizes:
        if n * capacity not in ideal_cache:
            ideal_cache[n * capacity] = ideal_hit_ratio(specs, n * capacity, args.block_tokens)
            floors = ttft_floors_s(specs, n * capacity, args.block_tokens, profile)
            floor_cache[n * capacity] = distribution_ms(floors)
        for sharing in sharing_modes:
            for policy, item in itertools.product(args.policy, args.disaggregated or ["0"]):
                try:
                    prefill = prefill_replicas(item, n)
                except ValueError as e:
                    raise SystemExit(str(e)) from None
                config = ClusterConfig(
                    replicas=n,
                    capacity_blocks=capacity,
                    policy=policy,
                    router_config=args.router_config,
                    block_tokens=args.block_tokens,
                    stats_period_s=args.stats_period,
                    kv_sharing=sharing,
                    directory_capacity_blocks=args.directory_capacity_blocks,
                    kv_min_blocks=args.kv_min_blocks,
                    directory_hint=not args.no_directory_hint,
                    max_ongoing_requests=args.max_ongoing_requests,
                    seed=args.seed,
                    replicas_per_node=args.replicas_per_node,
                )
                run = run_one(specs, profile, config, prefill)
                if prefill:
                    run["disaggregated"] = item
                run["ideal_hit_ratio"] = ideal_cache[n * capacity]
                run["ttft_floor_ms"] = floor_cache[n * capacity]
                run["hit_ratio_vs_ideal"] = (
                    run["hit_ratio"] / run["ideal_hit_ratio"] if run["ideal_hit_ratio"] else None
                )
                if live is not None and live.get("prefix_cache_hit_ratio"):
                    run["hit_ratio_vs_live"] = run["hit_ratio"] / live["prefix_cache_hit_ratio"]
                runs.append(run)
                if not args.quiet:
                    print(_one_line(run), file=sys.stderr, flush=True)
    title = (
        f"{args.trace.name}: {len(specs)} requests, block {args.block_tokens} tokens, "
        f"time x{args.time_scale:g}, {capacity} blocks/replica, profile {profile.name}"
    )
    if args.plot is not None:
        from benchmarks.sim.plot import plot_runs, plot_sweep

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        if len(sizes) > 1:
            plot_sweep(runs, args.plot, title)
        else:
            plot_runs(runs, args.plot, title)
    document = {
        "trace": str(args.trace),
        "num_requests": len(specs),
        "distinct_blocks": distinct,
        "capacity_blocks": capacity,
        "block_tokens": args.block_tokens,
        "time_scale": args.time_scale,
        "profile": profile.name,
        "router_config": args.router_config,
        "ideal_infinite_hit_ratio": ideal_hit_ratio(specs, None, args.block_tokens),
        "load_s": load_s,
        "wall_s": time.perf_counter() - started,
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    }
    if live is not None:
        document["live"] = {
            "source": str(args.live_json),
            "hit_ratio": live.get("prefix_cache_hit_ratio"),
            "completed": live.get("completed"),
            "ttft_ms": live.get("ttft_ms"),
            "e2e_latency_ms": live.get("e2e_latency_ms"),
            "replicas": live.get("replicas"),
        }
        if not args.quiet:
            ratio = live.get("prefix_cache_hit_ratio")
            print(f"live hit ratio: {ratio if ratio is None else round(ratio, 4)}", file=sys.stderr)
    text = json.dumps(document)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(document, indent=2) + "\n")
    print(text, flush=True)
    return document


def _one_line(run: dict[str, Any]) -> str:
    sharing = "+kv" if run["kv_sharing"] else ""
    if "prefill_replicas" in run:
        sharing += f" P/D {run['prefill_replicas']}/{run['replicas'] - run['prefill_replicas']}"
    itl = run["itl_ms"]
    return (
        f"N={run['replicas']:<4} {run['policy'] + sharing:<16} hit {run['hit_ratio']:.3f} "
        f"(ideal {run['ideal_hit_ratio']:.3f}, {run['hit_ratio_vs_ideal']:.1%}) "
        f"TTFT p50/p99 {run['ttft_ms']['p50']:.0f}/{run['ttft_ms']['p99']:.0f} ms "
        f"(floor {run['ttft_floor_ms']['p50']:.0f}/{run['ttft_floor_ms']['p99']:.0f})  "
        + (f"ITL p50/p99 {itl['p50']:.0f}/{itl['p99']:.0f} ms  " if itl["p50"] is not None else "")
        + f"E2E p50/p99 {run['e2e_ms']['p50']:.0f}/{run['e2e_ms']['p99']:.0f} ms  "
        f"{run['request_throughput']:.2f} req/s  util {run['utilization']['mean']:.2f}  busy max/mean "
        f"{run['busy_s_per_replica']['max_over_mean']:.2f}  reqs max/mean "
        f"{run['requests_per_replica']['max_over_mean']:.2f}  [{run['sim_wall_s']:.1f} s]"
        + (f"  sim/live hit {run['hit_ratio_vs_live']:.3f}" if "hit_ratio_vs_live" in run else "")
    )


if __name__ == "__main__":
    main()
