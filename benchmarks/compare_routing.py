"""Compare routing policies on a live 2-replica service: shared prefixes, and no sharing.

    python -m benchmarks.compare_routing [--policies prefix_aware,ray_prefix_affinity,power_of_two]

Ours (``prefix_aware``), Ray Serve's own ``PrefixCacheAffinityRouter`` (``ray_prefix_affinity``)
and power of two choices by default; ``round_robin`` may be added. For each policy it starts
``serve run`` on a variant of ``serve_config.yaml`` in the routed layout (an Ingress deployment
routes each prompt through the Engine handle: the one layout where Serve tells Ray's router where
each request went, so every policy runs in it), runs the shared-prefix workload (many system
prompts, few requests each, in random order) and a workload with no sharing (W1: distinct
prompts), and prints hit ratio, TTFT p50/p99 and throughput per policy, then one JSON line. The
hit ratio is the same for every policy: the cached tokens the engine replicas report in each
response's usage over its prompt tokens (``benchmarks.metrics``). KV sharing between replicas is
off by default so routing alone is compared (``--kv-sharing`` turns it on).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from benchmarks import serve as bench
from benchmarks.service import TWO_REPLICAS, config_variant, running_service
from deployments.config import AppArgs

POLICIES = ("prefix_aware", "ray_prefix_affinity", "power_of_two")
LABELS = {
    "prefix_aware": "ours",
    "ray_prefix_affinity": "Ray PrefixCacheAffinity",
    "power_of_two": "power of two",
    "round_robin": "round robin",
}


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    common = ["--disable-tqdm", "--ignore-eos", "--seed", str(args.seed)]
    return {
        "shared-prefix": [
            "--workload",
            "shared-prefix",
            "--num-groups",
            str(args.groups),
            "--prompts-per-group",
            str(args.per_group),
            "--prefix-len",
            str(args.prefix_len),
            "--question-len",
            "32",
            "--output-len",
            str(args.shared_output_len),
            "--arrival-order",
            args.arrival_order,
            "--concurrency",
            str(args.shared_concurrency),
            *common,
        ],
        "no-sharing": [
            "--workload",
            "random",
            "--num-prompts",
            str(args.random_prompts),
            "--input-len-min",
            "64",
            "--input-len-max",
            "128",
            "--output-len",
            "128",
            "--concurrency",
            str(args.random_concurrency),
            *common,
        ],
    }


def service_config(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """``serve_config.yaml`` with two engine replicas (a core each) under ``policy``."""
    config = config_variant(
        {
            "layout": args.layout,
            "routing_policy": policy,
            "kv_sharing": {"enabled": args.kv_sharing},
        },
        TWO_REPLICAS,
    )
    if args.layout == "routed":
        app = config["applications"][0]
        # As in the KubeRay manifests: the ingress takes no CPU of Ray's, the engines one each.
        app["deployments"].append(
            {"name": "Ingress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}
        )
        # serve_config.yaml sends every token as its own item (a socket write under direct
        # ingress); routed, each item also crosses the ingress process, which on 2 cores then
        # takes CPU from the engines. TTFT is unaffected: the first token goes out at once.
        app["args"]["stream_interval_ms"] = AppArgs.model_fields["stream_interval_ms"].default
    return config


def row(policy: str, workload: str, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "policy": policy,
        "workload": workload,
        "completed": s["completed"],
        "failed": s["failed"],
        "hit_ratio": s["prefix_cache_hit_ratio"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "output_tok_s": s["output_token_throughput"],
        "req_s": s["request_throughput"],
        "max_replica_share": (s.get("replicas") or {}).get("max_share"),
    }


def round_order(policies: list[str], round_: int) -> list[str]:
    """The policies in the order round ``round_`` runs them: rotated by one place a round, so
    that over as many rounds as policies each runs once in every position (first, straight
    after the previous round's service shut down, included). Reversing every other round
    instead ran the first policy first in two rounds of three."""
    k = round_ % len(policies) if policies else 0
    return policies[k:] + policies[:k]


MEDIAN_FIELDS = ("hit_ratio", "ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "req_s")


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, workload), in first-run order: each figure's median over the rounds
    (failures summed, the largest replica share kept)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["policy"], r["workload"]), []).append(r)
    out = []
    for (policy, workload), rs in groups.items():
        merged: dict[str, Any] = {"policy": policy, "workload": workload, "rounds": len(rs)}
        merged["completed"] = sum(r["completed"] for r in rs)
        merged["failed"] = sum(r["failed"] for r in rs)
        for key in MEDIAN_FIELDS:
            values = [r[key] for r in rs if r[key] is not None]
            merged[key] = statistics.median(values) if values else None
        shares = [r["max_replica_share"] for r in rs if r["max_replica_share"] is not None]
        merged["max_replica_share"] = max(shares) if shares else None
        out.append(merged)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--kv-sharing", action="store_true")
    # Ray's router learns where prefixes went only in the routed layout; direct is for comparing
    # our own policies as `make serve` runs them (HAProxy asks the replica chooser).
    p.add_argument("--layout", choices=["routed", "direct"], default="routed")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--shared-output-len", type=int, default=16)
    p.add_argument("--shared-concurrency", type=int, default=4)
    p.add_argument("--random-prompts", type=int, default=64)
    p.add_argument("--random-concurrency", type=int, default=64)
    # Random order by default: with interleaved arrivals and an even number of groups, round
    # robin over 2 replicas sends every request of a group to the same replica by parity alone.
    p.add_argument(
        "--arrival-order", choices=["interleaved", "grouped", "random"], default="random"
    )
    p.add_argument("--workloads", default="shared-prefix,no-sharing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="each service's log and each run's per-request results go here",
    )
    # On a shared 2-core machine one run's TTFT percentiles move by a fifth between identical
    # runs; rounds take the policies in turn (a fresh service each time, the same prompts) and
    # the table shows each figure's median over them.
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")

    configs = {}
    for policy in args.policies.split(","):
        configs[policy] = service_config(policy, args)
        try:  # a bad policy or layout fails here, before any service starts
            AppArgs.model_validate(configs[policy]["applications"][0]["args"])
        except ValidationError as e:
            p.error(str(e))
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_ in range(args.rounds):
        for policy in round_order(list(configs), round_):
            config = configs[policy]
            log = None
            if args.log_dir is not None:
                log = args.log_dir / f"serve-{policy}-{round_}.log"
            with running_service(config, port=args.port, log_path=log) as url:
                selected = args.workloads.split(",")
                for name, wl in workloads(args).items():
                    if name not in selected:
                        continue
                    extra = []
                    if args.log_dir is not None:  # every request's timings, for reading a tail
                        out = args.log_dir / f"requests-{policy}-{name}-{round_}.json"
                        extra = ["--output-json", str(out), "--save-requests"]
                    summary = bench.main(["--base-url", url, *wl, *extra])
                    runs.append({**row(policy, name, summary), "round": round_})
    rows = medians(runs)
    print()
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds")
    header = f"{'policy':<25}{'workload':<15}{'hit':>7}{'TTFT p50':>11}{'TTFT p99':>11}{'tok/s':>9}{'max share':>11}"
    print(header)
    # Side by side: each workload's policies together.
    for r in sorted(rows, key=lambda r: (r["workload"] != "shared-prefix", r["workload"])):
        share = r["max_replica_share"]
        print(
            f"{LABELS.get(r['policy'], r['policy']):<25}{r['workload']:<15}{(r['hit_ratio'] or 0):>7.2f}"
            f"{r['ttft_p50_ms']:>9.0f}ms{r['ttft_p99_ms']:>9.0f}ms{r['output_tok_s']:>9.1f}"
            f"{(share if share is not None else float('nan')):>11.2f}"
        )
    print(
        json.dumps(
            {"kv_sharing": args.kv_sharing, "layout": args.layout, "rows": rows, "runs": runs}
        )
    )
    return rows


if __name__ == "__main__":
    main()
