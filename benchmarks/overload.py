"""One innocent stream beside the widest request the schema admits: how much slower it gets.

    python -m benchmarks.overload                      # starts serve_config.yaml's server
    python -m benchmarks.overload --base-url http://127.0.0.1:8000   # a server already running

The innocent request is one streaming completion (greedy, ``ignore_eos``). It runs alone, then
beside a "wide" request of the same shape as the worst one but with no stop strings or bias (what
its batch rows alone cost), then beside the worst request the schema admits: the most prompts x n
sequences (``deployments.request_limits``), the most stop strings at the longest length (all
ending in a space, the character the index finds most candidates for), the most stop token ids
and logit_bias entries. The load starts first and the innocent stream starts once the load
streams, so its prefill is not in the gaps. Prints each condition's median inter-token gap of
the innocent stream and the ratios to its unloaded value; the last line is the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks import servers
from benchmarks.client import ClientConfig, auth_headers, fetch_first_model, stream_request
from benchmarks.metrics import RequestResult
from benchmarks.sse import SSEDecoder
from benchmarks.workloads import WorkloadRequest
from deployments.request_limits import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_SEQUENCES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

CONDITIONS = ("alone", "wide", "worst")
# Token ids well inside any Llama-family vocabulary, away from special tokens.
FIRST_ID = 1000
LOAD_WARMUP_S = 3.0


def wide_body(
    model: str, max_tokens: int, worst: bool, sequences: int = MAX_SEQUENCES, stream: bool = True
) -> dict[str, Any]:
    """``sequences`` sequences (default the bound) as prompts of n = up to MAX_N choices each;
    with ``worst``, every per-token table at its bound too."""
    n = min(MAX_N, sequences)
    prompts = [[FIRST_ID + 37 * p + i for i in range(32)] for p in range(max(1, sequences // n))]
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompts,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "stream": stream,
    }
    if worst:
        # Distinct lengths ending in a space: each space of the output is a candidate end for all
        # of them. The "\x01" start keeps any from matching, so every sequence runs to the end.
        body["stop"] = [
            "\x01" + "q" * (MAX_STOP_STRING_CHARS - 2 - i) + " " for i in range(MAX_STOP_STRINGS)
        ]
        body["stop_token_ids"] = [40000 + i for i in range(MAX_STOP_TOKEN_IDS)]
        body["logit_bias"] = {str(30000 + i): 0.01 for i in range(MAX_LOGIT_BIAS)}
    return body


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    started: asyncio.Event,
    counts: dict[str, int],
) -> None:
    """Stream the load request until cancelled, setting ``started`` at its first chunk (a load
    that is not streamed sets it after ``LOAD_WARMUP_S``, its prefill long done by then)."""
    if not body["stream"]:
        asyncio.get_running_loop().call_later(LOAD_WARMUP_S, started.set)
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"load request refused: {response.status_code} {(await response.aread())[:300]!r}"
            )
        decoder = SSEDecoder()
        async for line in response.aiter_lines():
            event = decoder.feed_line(line, 0.0)
            if event is None or event.data.strip() == "[DONE]":
                continue
            counts["chunks"] = counts.get("chunks", 0) + 1
            started.set()


async def innocent(client: httpx.AsyncClient, config: ClientConfig, tokens: int) -> list[float]:
    request = WorkloadRequest([FIRST_ID + 500 + i for i in range(24)], tokens)
    result = RequestResult(index=0)
    await stream_request(client, config, request, result)
    if result.outcome != "ok":
        raise RuntimeError(f"innocent request failed: {result.error}")
    return result.itls


async def measure(
    client: httpx.AsyncClient, config: ClientConfig, condition: str, args: argparse.Namespace
) -> tuple[list[float], int, float]:
    """The innocent stream's gaps under ``condition``, the load's chunks meanwhile, and how long
    the innocent stream took (the load's chunks over it are the load's own rate beside it)."""
    tokens = args.tokens
    if condition == "alone":
        return await innocent(client, config, tokens), 0, 0.0
    # Long enough to outlast the innocent stream even when each step serves all its sequences.
    body = wide_body(
        config.model,
        4 * tokens + 64,
        worst=condition == "worst",
        sequences=args.load_sequences,
        stream=args.load_stream,
    )
    started, counts = asyncio.Event(), {}
    load = asyncio.create_task(
        run_load(client, config.url, body, auth_headers(config.api_key), started, counts)
    )
    try:
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED, timeout=300)
        if load.done():
            load.result()  # raises the refusal
        if not started.is_set():
            raise RuntimeError("the load request produced nothing within 300 s")
        waiter.cancel()
        chunks_before, started_at = counts.get("chunks", 0), time.perf_counter()
        gaps = await innocent(client, config, tokens)
        elapsed = time.perf_counter() - started_at
        if load.done():
            raise RuntimeError("the load ended before the innocent stream did; raise max_tokens")
        return gaps, counts.get("chunks", 0) - chunks_before, elapsed
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await load


def cpu_description() -> str:
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in out.splitlines()
                if line.startswith("Model name")
            ),
            "",
        )
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    present = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model or 'unknown CPU'}; {', '.join(present) or 'no avx512_bf16/amx'}"


async def run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = args.model or await fetch_first_model(client, base_url, args.api_key)
        config = ClientConfig(
            base_url=base_url, model=model, temperature=0.0, ignore_eos=True, api_key=args.api_key
        )
        await innocent(client, config, 8)  # warm-up
        gaps: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        load_chunks: dict[str, int] = {c: 0 for c in CONDITIONS}
        load_seconds: dict[str, float] = {c: 0.0 for c in CONDITIONS}
        for round_ in range(args.rounds):
            for condition in CONDITIONS:
                got, chunks, seconds = await measure(client, config, condition, args)
                gaps[condition] += got
                load_chunks[condition] += chunks
                load_seconds[condition] += seconds
                print(
                    f"  round {round_ + 1} {condition:5s}: median gap "
                    f"{statistics.median(got) * 1e3:7.1f} ms over {len(got)} gaps",
                    file=sys.stderr,
                    flush=True,
                )
    medians = {c: statistics.median(g) * 1e3 for c, g in gaps.items()}
    return {
        "cpu": cpu_description(),
        "base_url": base_url,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "load_sequences": args.load_sequences,
        "load_stream": args.load_stream,
        "median_gap_ms": {c: round(m, 2) for c, m in medians.items()},
        "ratio_wide": round(medians["wide"] / medians["alone"], 3),
        "ratio_worst": round(medians["worst"] / medians["alone"], 3),
        "worst_vs_wide": round(medians["worst"] / medians["wide"], 3),
        # The load's chunks while the innocent stream ran, and their rate: the load's throughput
        # beside it (a chunk is one choice's new tokens: one token unless its deltas queued up).
        "load_chunks": load_chunks,
        "load_chunks_per_s": {
            c: round(load_chunks[c] / load_seconds[c], 1) for c in CONDITIONS if load_seconds[c]
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server; default: start --config's server")
    p.add_argument("--config", type=Path, default=servers.DEFAULT_CONFIG)
    p.add_argument("--model", help="default: the first model GET /v1/models lists")
    p.add_argument("--api-key")
    p.add_argument("--tokens", type=int, default=96, help="innocent stream's max_tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--load-sequences",
        type=int,
        default=MAX_SEQUENCES,
        help="sequences of the load request (default: the most the schema admits)",
    )
    p.add_argument(
        "--load-stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the load request (default) or wait for its whole answer",
    )
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    server = None
    base_url = args.base_url
    if base_url is None:
        spec = servers.read_serve_config(args.config)
        servers.wait_port_free(spec.host, spec.port, 600.0)
        log = Path(tempfile.mkdtemp(prefix="overload-")) / "server.log"
        print(f"starting {spec.config_path.name} (log {log})", file=sys.stderr, flush=True)
        server = servers.start_ours(spec, log)
        base_url = spec.base_url
    try:
        if server is not None:
            servers.wait_ready(server, args.start_timeout)
        summary = asyncio.run(run(args, base_url))
    finally:
        if server is not None:
            servers.stop(server)
    m = summary["median_gap_ms"]
    print(f"CPU: {summary['cpu']}")
    print(f"innocent stream, median inter-token gap over {args.rounds} rounds:")
    print(f"  alone                          {m['alone']:8.1f} ms")
    print(
        f"  beside {args.load_sequences:3d} plain sequences     {m['wide']:8.1f} ms  "
        f"({summary['ratio_wide']:.2f}x)"
    )
    print(
        f"  beside the worst request       {m['worst']:8.1f} ms  "
        f"({summary['ratio_worst']:.2f}x; {summary['worst_vs_wide']:.2f}x the plain ones)"
    )
    rates = summary["load_chunks_per_s"]
    print(f"load chunks/s beside it: plain {rates['wide']:.1f}, worst {rates['worst']:.1f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
