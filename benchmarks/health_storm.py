"""``GET /health`` under a storm of probes, and whether the storm slows generation.

Against a server that is already running (``make serve``), or with ``--start`` against one it
starts the way ``make serve`` does (``benchmarks.servers``: the shipped config in the Makefile's
environment, a Ray cluster of its own) and stops at the end:

    python -m benchmarks.health_storm --base-url http://127.0.0.1:8000
    python -m benchmarks.health_storm --start

1. Latency: ``--rounds`` bursts of ``--calls`` concurrent ``GET /health`` (after one burst that
   opens the connections); p50, p99 and max over every call, and the status codes. The same
   bursts, interleaved round by round, go to ``--compare`` routes: ``/ping`` (our route that does
   nothing) and ``/-/healthz`` (Serve's own health route), which
   tell what Serve's HTTP path and the client cost per call whatever the route does. With
   direct ingress HAProxy answers ``/-/healthz`` itself, so that route measures the client and
   HAProxy alone.
2. Generation: one streaming completion (greedy, ``--max-tokens`` tokens, ``ignore_eos``) alone,
   then again while a burst of ``--calls`` concurrent ``/health`` calls goes out every
   ``--storm-interval-s``; alternated ``--repeats`` times. Per stream: TPOT (time from the first
   content event to the last over the tokens in between) and the median gap between content
   events (the server coalesces tokens into events, so a gap can span several tokens).

The client shares the machine's CPUs with the server: its own work per storm (100 requests
from Python) is part of what the generation numbers include. Not a timed test: it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from benchmarks.client import auth_headers, fetch_first_model, server_root

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides through the night."


@dataclass
class StreamTiming:
    tokens: int
    tpot_ms: float
    median_gap_ms: float


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


async def health_burst(
    client: aiohttp.ClientSession, url: str, calls: int, headers: dict[str, str]
) -> tuple[list[float], Counter[int]]:
    """``calls`` concurrent GET ``url``: each call's latency in ms, and the status codes."""

    async def one() -> tuple[float, int]:
        start = time.perf_counter()
        async with client.get(url, headers=headers) as r:
            await r.read()
            return (time.perf_counter() - start) * 1000, r.status

    results = await asyncio.gather(*(one() for _ in range(calls)))
    return [ms for ms, _ in results], Counter(code for _, code in results)


async def stream_timing(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int, headers: dict[str, str]
) -> StreamTiming:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c.get("text") for c in event.get("choices") or []):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return StreamTiming(
        tokens=tokens,
        tpot_ms=(times[-1] - times[0]) / max(1, tokens - 1) * 1000,
        median_gap_ms=statistics.median(gaps) * 1000 if gaps else float("nan"),
    )


async def with_storm(
    client: httpx.AsyncClient,
    prober: aiohttp.ClientSession,
    args: argparse.Namespace,
    urls: tuple[str, str],
    model: str,
    headers: dict[str, str],
) -> tuple[StreamTiming, list[float], Counter[int]]:
    """One stream while bursts of /health go out every ``storm_interval_s``."""
    health_url, completions_url = urls
    latencies: list[float] = []
    codes: Counter[int] = Counter()
    stream = asyncio.create_task(
        stream_timing(client, completions_url, model, args.max_tokens, headers)
    )
    while not stream.done():
        ms, c = await health_burst(prober, health_url, args.calls, headers)
        latencies += ms
        codes += c
        await asyncio.wait([stream], timeout=args.storm_interval_s)
    return await stream, latencies, codes


def summary(ms: list[float]) -> str:
    p50, p99 = np.percentile(ms, [50, 99])
    return f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(ms):.1f} ms ({len(ms)} calls)"


async def main(args: argparse.Namespace) -> None:
    root = server_root(args.base_url)
    headers = auth_headers(args.api_key)
    limits = httpx.Limits(max_connections=2 * args.calls, max_keepalive_connections=2 * args.calls)
    # The probes go through aiohttp: httpx's per-request CPU cost on a 2-core machine would
    # dominate what is measured (the client shares the cores with the server).
    connector = aiohttp.TCPConnector(limit=2 * args.calls)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with (
        httpx.AsyncClient(limits=limits, timeout=60.0) as client,
        aiohttp.ClientSession(connector=connector, timeout=timeout) as prober,
    ):
        model = args.model or await fetch_first_model(client, root, args.api_key)
        health_url, completions_url = f"{root}/health", f"{root}/v1/completions"
        print(
            f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); server {root}; model {model}; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        paths = ["/health", *args.compare]
        latencies: dict[str, list[float]] = {path: [] for path in paths}
        codes: dict[str, Counter[int]] = {path: Counter() for path in paths}
        for path in paths:  # opens the connections
            await health_burst(prober, root + path, args.calls, headers)
        for _ in range(args.rounds):
            for path in paths:
                ms, c = await health_burst(prober, root + path, args.calls, headers)
                latencies[path] += ms
                codes[path] += c
                await asyncio.sleep(args.pause_s)
        for path in paths:
            print(
                f"{path}, {args.calls} concurrent x {args.rounds}: {summary(latencies[path])}; "
                f"{dict(codes[path])}"
            )

        alone: list[StreamTiming] = []
        stormed: list[StreamTiming] = []
        storm_latencies: list[float] = []
        storm_codes: Counter[int] = Counter()
        for _ in range(args.repeats):
            alone.append(
                await stream_timing(client, completions_url, model, args.max_tokens, headers)
            )
            timing, ms, c = await with_storm(
                client, prober, args, (health_url, completions_url), model, headers
            )
            stormed.append(timing)
            storm_latencies += ms
            storm_codes += c
        for name, runs in (("alone", alone), ("with the /health storm", stormed)):
            print(
                f"generation {name}: TPOT "
                f"{', '.join(f'{t.tpot_ms:.1f}' for t in runs)} ms "
                f"(median {statistics.median(t.tpot_ms for t in runs):.1f}); median gap between "
                f"events {statistics.median(t.median_gap_ms for t in runs):.1f} ms; "
                f"{runs[0].tokens} tokens"
            )
        print(
            f"/health during the storm ({args.calls} concurrent every {args.storm_interval_s:g} "
            f"s): {summary(storm_latencies)}; {dict(storm_codes)}"
        )
        print(f"load average at the end {os.getloadavg()[0]:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("PREFIXSERVE_API_KEY"))
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--calls", type=int, default=100, help="concurrent /health calls per burst")
    p.add_argument("--rounds", type=int, default=10, help="bursts for the latency figures")
    p.add_argument(
        "--compare",
        nargs="*",
        default=["/ping", "/-/healthz"],
        help="routes burst the same way, for comparison",
    )
    p.add_argument("--pause-s", type=float, default=0.5, help="pause between those bursts")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="streams alone and with the storm")
    p.add_argument("--storm-interval-s", type=float, default=1.0)
    p.add_argument(
        "--start", action="store_true", help="start make serve's server first (and stop it)"
    )
    p.add_argument("--config", type=Path, default=None, help="with --start: a serve config")
    return p.parse_args(argv)


def run_with_server(args: argparse.Namespace) -> None:
    from benchmarks import servers

    spec = servers.read_serve_config(args.config or servers.DEFAULT_CONFIG)
    servers.wait_port_free(spec.host, spec.port, timeout_s=600)
    log = Path(tempfile.mkdtemp(prefix="health_storm-")) / "server.log"
    server = servers.start_ours(spec, log)
    try:
        ready_s = servers.wait_ready(server, 600)
        print(f"server ready after {ready_s:.0f} s (log {log})")
        args.base_url = spec.base_url
        asyncio.run(main(args))
    finally:
        servers.stop(server)


if __name__ == "__main__":
    cli = parse_args()
    if cli.start:
        run_with_server(cli)
    else:
        asyncio.run(main(cli))
