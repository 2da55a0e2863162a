"""Long prompts arriving beside steady decoding streams: colocated vs prefill/decode disaggregated.

    python -m benchmarks.interference                          # both modes, one after the other
    python -m benchmarks.interference --modes disaggregated    # one mode (a JSON line per mode)

Each mode starts the shipped ``serve_config.yaml``'s model and engine options as a routed app
with KV sharing on, two engine replicas of one CPU each (pinned, one core each;
``deployments/cpu_affinity.py``): ``colocated`` runs two Engine replicas that both prefill and
decode; ``disaggregated`` runs one Prefill and one Engine (decode) replica. The workload: a
steady set of decoding streams (short prompts, long outputs) starts first; once they stream, long
prompts (distinct, so no cache hit) arrive at a fixed period, each with a few output tokens. The
decoding streams are measured while the long prompts arrive (their inter-token gaps, ITL, from
the first long prompt's send to the last one's end) and then cancelled; the long prompts by their
time to first token (TTFT). Prints a table; the last line is the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import servers
from benchmarks.client import ClientConfig, stream_request
from benchmarks.metrics import RequestResult
from benchmarks.slo_classes import percentile
from benchmarks.workloads import WorkloadRequest

MODES = ("colocated", "disaggregated")
# Token ids well inside any Llama-family vocabulary, away from special tokens.
LOW_ID, HIGH_ID = 1000, 40000


def mode_config(base: Path, mode: str, stream_interval_ms: float) -> dict[str, Any]:
    """``base`` (a serve_config.yaml) as a routed, KV-sharing app of two one-CPU engine
    replicas in ``mode``."""
    config = yaml.safe_load(base.read_text())
    app = servers._model_app(config)
    args = app.setdefault("args", {})
    args.update(
        layout="routed",
        routing_policy="prefix_aware",
        stream_interval_ms=stream_interval_ms,
        kv_sharing={**(args.get("kv_sharing") or {}), "enabled": True},
        disaggregation={"enabled": mode == "disaggregated", "prefill_replicas": 1},
    )
    deployments = [
        {
            "name": "Engine",
            "num_replicas": 2 if mode == "colocated" else 1,
            "ray_actor_options": {"num_cpus": 1},
        },
        {"name": "Ingress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
    ]
    if mode == "disaggregated":
        deployments.append(
            {"name": "Prefill", "num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}
        )
    app["deployments"] = deployments
    return config


def workload(args: argparse.Namespace) -> tuple[list[WorkloadRequest], list[WorkloadRequest]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]

    decoding = [WorkloadRequest(ids(args.decode_prompt_len), 4096) for _ in range(args.streams)]
    long = [
        WorkloadRequest(ids(args.long_prompt_len), args.long_output_len)
        for _ in range(args.long_prompts)
    ]
    return decoding, long


async def run_mode(
    base_url: str, model: str, args: argparse.Namespace
) -> tuple[list[RequestResult], list[RequestResult], float]:
    """The decoding streams' and the long prompts' results, and the measured window (s)."""
    decoding, long = workload(args)
    config = ClientConfig(base_url=base_url, model=model, ignore_eos=True)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        dec_results = [RequestResult(index=i) for i in range(len(decoding))]
        tasks = []
        for r, res in zip(decoding, dec_results, strict=True):
            res.send_time = time.perf_counter()
            tasks.append(asyncio.create_task(stream_request(client, config, r, res)))
        # Every decoding stream is streaming before the first long prompt.
        deadline = time.monotonic() + 60
        while any(r.ttft is None for r in dec_results):
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError(f"decoding streams did not start: {dec_results}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.warmup_s)
        skip = [len(r.itls) for r in dec_results]
        long_results = [RequestResult(index=i) for i in range(len(long))]
        started = time.monotonic()
        long_tasks = []
        for i, (req, res) in enumerate(zip(long, long_results, strict=True)):
            if i:
                await asyncio.sleep(args.period_s)
            res.send_time = time.perf_counter()
            long_tasks.append(asyncio.create_task(stream_request(client, config, req, res)))
        await asyncio.gather(*long_tasks)
        window = time.monotonic() - started
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    if args.timeline:
        timeline(dec_results, long_results, skip)
    for r, n in zip(dec_results, skip, strict=True):
        r.itls = r.itls[n:]
    return dec_results, long_results, window


def timeline(dec: list[RequestResult], long: list[RequestResult], skip: list[int]) -> None:
    """When the long prompts ran and when the decoding streams' gaps over 100 ms ended,
    in seconds from the first long prompt's send (send times are the client's clock before
    the request; close enough to place gaps)."""
    t0 = long[0].send_time
    for i, r in enumerate(long):
        end = (r.send_time + r.latency - t0) if r.latency else None
        print(f"long {i}: sent {r.send_time - t0:6.2f} ttft {r.ttft or 0:5.2f} end {end}")
    for k, (r, n) in enumerate(zip(dec, skip, strict=True)):
        t = r.send_time + (r.ttft or 0)
        for j, gap in enumerate(r.itls):
            t += gap
            if j >= n and gap > 0.1:
                print(f"  stream {k}: gap {gap * 1000:5.0f} ms ending {t - t0:6.2f}")


def summarize(mode: str, dec: list[RequestResult], long: list[RequestResult], window: float):
    itls = [x * 1000 for r in dec for x in r.itls]
    ttfts = [r.ttft * 1000 for r in long if r.outcome == "ok" and r.ttft is not None]
    errors = [r.error for r in long if r.outcome != "ok"]
    return {
        "mode": mode,
        "window_s": round(window, 1),
        "decode_tokens": len(itls),
        "itl_p50_ms": round(percentile(itls, 50), 1),
        "itl_p99_ms": round(percentile(itls, 99), 1),
        "itl_max_ms": round(max(itls), 1),
        "long_ok": len(ttfts),
        "long_errors": errors[:3],
        "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 99), 1) if ttfts else None,
    }


def server_figures(base_url: str) -> dict[str, Any]:
    """Handoff and KV import figures from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("prefixserve_handoff") or (
                s.name == "prefixserve_prefix_cache_hit_tokens_total"
                and s.labels.get("source") == "remote"
            ):
                outcome = s.labels.get("outcome")
                key = f"{s.name}{{{outcome}}}" if outcome else s.name
                if "bucket" not in key:
                    sums[key] = sums.get(key, 0.0) + s.value
    return {"server": {k: round(v, 3) for k, v in sorted(sums.items())}}


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["mode", "decode_tokens", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ok"]
    cols += ["ttft_p50_ms", "ttft_p99_ms"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=servers.ROOT / "serve_config.yaml")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--streams", type=int, default=8, help="decoding streams")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-prompt-len", type=int, default=1500)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--period-s", type=float, default=4.0, help="between long prompts")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    # The routed layout's default: at one item per token (0) the items' cost in the ingress,
    # the proxy and the client takes the decode replica's core (docs/disaggregation.md).
    p.add_argument("--stream-interval-ms", type=float, default=20.0)
    p.add_argument("--ready-timeout-s", type=float, default=240.0)
    p.add_argument("--timeline", action="store_true", help="print long prompts and big gaps")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="interference-") as tmp:
        for mode in args.modes:
            path = Path(tmp) / f"{mode}.yaml"
            config = mode_config(args.config, mode, args.stream_interval_ms)
            path.write_text(yaml.safe_dump(config))
            spec = servers.read_serve_config(path)
            servers.wait_port_free(spec.host, spec.port, 120)
            server = servers.start_ours(spec, Path(tmp) / f"{mode}.log")
            try:
                ready_s = servers.wait_ready(server, args.ready_timeout_s)
                print(f"{mode}: ready after {ready_s:.0f} s", flush=True)
                dec, long, window = asyncio.run(
                    run_mode(spec.base_url, spec.served_model_name, args)
                )
                figures = server_figures(spec.base_url)
            finally:
                servers.stop(server)
            rows.append({**summarize(mode, dec, long, window), **figures})
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
