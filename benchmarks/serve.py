"""Streaming load generator for any OpenAI-compatible server (prefixserve, ``vllm serve``, SGLang).

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 64 --concurrency 32

Prints a summary table, then the summary as one JSON line (always the last line of stdout);
progress and warnings go to stderr. See docs/benchmarks.md for the workloads and flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks import workloads
from benchmarks.client import (
    ClientConfig,
    Renderer,
    fetch_first_model,
    stream_request,
    synthetic_text,
    tokenizer_renderer,
)
from benchmarks.metrics import RequestResult, format_table, summarize
from benchmarks.workloads import WorkloadRequest


@dataclass
class BenchmarkRun:
    """Results of one run. ``results`` holds every request that was sent, in send order;
    ``num_not_sent`` counts those the run time limit kept from being sent."""

    results: list[RequestResult]
    duration: float
    num_not_sent: int

    def summary(self) -> dict[str, Any]:
        return summarize(self.results, self.duration, num_not_sent=self.num_not_sent)


def arrival_schedule(
    requests: Sequence[WorkloadRequest], request_rate: float | None, seed: int = 0
) -> list[float]:
    """Send times (seconds from the start of the run), non-decreasing.

    ``request_rate`` None: each request's own ``arrival_time`` (0 when it has none); ``inf``: all
    at once; otherwise a Poisson process of that rate (exponential gaps, seeded; the first request
    goes at 0).
    """
    if request_rate is None:
        times = [r.arrival_time or 0.0 for r in requests]
        return np.maximum.accumulate(times).tolist() if times else []
    if request_rate <= 0:
        raise ValueError(f"request_rate: must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * len(requests)
    rng = np.random.default_rng([seed, 1])
    gaps = rng.exponential(1.0 / request_rate, size=len(requests))
    gaps[:1] = 0.0
    return np.cumsum(gaps).tolist()


async def run_benchmark(
    requests: Sequence[WorkloadRequest],
    config: ClientConfig,
    *,
    concurrency: int | None = None,
    request_rate: float | None = math.inf,
    max_duration: float | None = None,
    seed: int = 0,
    render: Renderer = synthetic_text,
    progress: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchmarkRun:
    """Send ``requests`` on the :func:`arrival_schedule`, at most ``concurrency`` in flight (None:
    unbounded). A request waits for a free slot after its arrival time; ``client_wait`` in the
    summary measures that wait. After ``max_duration`` seconds, unsent requests are dropped and
    in-flight ones cancelled (reported as ``cancelled``)."""
    schedule = arrival_schedule(requests, request_rate, seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(config.request_timeout, connect=min(30.0, config.request_timeout))
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    started: list[RequestResult] = []
    tasks: list[asyncio.Task[None]] = []
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, unit="req")

    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        t0 = time.perf_counter()

        async def one(index: int, request: WorkloadRequest, scheduled: float) -> None:
            async with semaphore or contextlib.nullcontext():
                result = RequestResult(index=index, outcome="cancelled", scheduled_time=scheduled)
                result.send_time = time.perf_counter() - t0
                started.append(result)
                await stream_request(client, config, request, result, render)
                bar.update(1)

        async def dispatch_and_wait() -> None:
            for index, (request, at) in enumerate(zip(requests, schedule, strict=True)):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(index, request, at)))
            await asyncio.gather(*tasks)

        try:
            async with asyncio.timeout(max_duration):
                await dispatch_and_wait()
        except TimeoutError:
            pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
    bar.close()
    for result in started:
        if result.outcome == "cancelled":
            result.error = "cancelled at the run time limit"
    return BenchmarkRun(started, duration, num_not_sent=len(requests) - len(started))


# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve",
        description="Streaming load generator for OpenAI-compatible servers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (or .../v1)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--model", default=None, help="model name; default: first of GET /v1/models")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="completions only: send token ids, or text rendered from them (chat is always text)",
    )
    s.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir or model name used to render prompts as text; "
        "default: synthetic words (approximate lengths)",
    )
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (exact lengths)")
    s.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into each body")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    ld = p.add_argument_group("load")
    ld.add_argument("--num-prompts", type=int, default=None,
                    help="random: number of prompts (default 64); others: keep the first N")  # fmt: skip
    ld.add_argument(
        "--concurrency", type=int, default=32, help="max requests in flight; 0 = no limit"
    )
    ld.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (inf = all at once); default: the trace's own "
        "timestamps for --workload trace, inf otherwise",
    )
    ld.add_argument("--max-duration", type=float, default=1800.0,
                    help="seconds; then stop sending and cancel in-flight requests")  # fmt: skip
    ld.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    ld.add_argument("--disable-tqdm", action="store_true")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "trace"], default="random")
    w.add_argument("--vocab-size", type=int, default=workloads.DEFAULT_VOCAB_SIZE)
    w.add_argument("--output-len", type=int, default=128, help="random and shared-prefix")
    w.add_argument("--input-len-min", type=int, default=64)
    w.add_argument("--input-len-max", type=int, default=128)
    w.add_argument("--num-groups", type=int, default=8)
    w.add_argument("--prompts-per-group", type=int, default=8)
    w.add_argument("--prefix-len", type=int, default=512)
    w.add_argument("--question-len", type=int, default=64)
    w.add_argument("--arrival-order", choices=["interleaved", "grouped", "random"],
                   default="interleaved")  # fmt: skip
    w.add_argument("--trace-path", type=Path, default=None, help="Mooncake-format JSONL trace")
    w.add_argument("--trace-block-tokens", type=int, default=16,
                   help="tokens per trace hash id (each stands for 512 tokens)")  # fmt: skip
    w.add_argument("--trace-output-scale", type=float, default=1.0)
    w.add_argument("--max-output-len", type=int, default=128, help="trace: output length cap")
    w.add_argument("--max-input-len", type=int, default=None, help="trace: prompt length cap")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: arrival = timestamp * time-scale (0.1 = 10x faster)")  # fmt: skip
    w.add_argument("--trace-limit", type=int, default=None, help="trace: first N records")
    w.add_argument("--trace-offset", type=int, default=0,
                   help="trace: skip the first N records (arrivals start at the next one)")  # fmt: skip

    o = p.add_argument_group("output")
    o.add_argument("--output-json", type=Path, default=None, help="write summary and config here")
    o.add_argument("--save-requests", action="store_true",
                   help="also write per-request results into --output-json")  # fmt: skip
    return p


def make_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.workload == "random":
        reqs = workloads.random_requests(
            args.num_prompts if args.num_prompts is not None else 64,
            input_len_min=args.input_len_min,
            input_len_max=args.input_len_max,
            output_len=args.output_len,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    elif args.workload == "shared-prefix":
        reqs = workloads.shared_prefix_requests(
            num_groups=args.num_groups,
            prompts_per_group=args.prompts_per_group,
            prefix_len=args.prefix_len,
            question_len=args.question_len,
            output_len=args.output_len,
            arrival_order=args.arrival_order,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    else:
        if args.trace_path is None:
            raise SystemExit("--workload trace needs --trace-path")
        reqs = workloads.trace_requests(
            args.trace_path,
            block_tokens=args.trace_block_tokens,
            output_scale=args.trace_output_scale,
            max_output_len=args.max_output_len,
            time_scale=args.time_scale,
            limit=args.trace_limit,
            offset=args.trace_offset,
            max_input_len=args.max_input_len,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    return reqs[: args.num_prompts] if args.num_prompts is not None else reqs


async def _resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            return await fetch_first_model(client, args.base_url, args.api_key)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        raise SystemExit(f"cannot find the model at {args.base_url} ({e}); pass --model") from e


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    requests = make_workload(args)
    if not requests:
        raise SystemExit("the workload is empty")
    model = asyncio.run(_resolve_model(args))
    needs_text = args.endpoint == "chat" or args.prompt_format == "text"
    render = tokenizer_renderer(args.tokenizer) if needs_text and args.tokenizer else synthetic_text
    config = ClientConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        prompt_format=args.prompt_format,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        extra_body=args.extra_body,
        request_timeout=args.request_timeout,
    )
    request_rate = args.request_rate
    if request_rate is None and args.workload != "trace":
        request_rate = math.inf
    run = asyncio.run(
        run_benchmark(
            requests,
            config,
            concurrency=args.concurrency or None,
            request_rate=request_rate,
            max_duration=args.max_duration,
            seed=args.seed,
            render=render,
            progress=not args.disable_tqdm,
        )
    )
    summary: dict[str, Any] = {
        "workload": args.workload,
        "endpoint": args.endpoint,
        "model": model,
        "base_url": args.base_url,
        "concurrency": args.concurrency or None,
        "request_rate": "trace" if request_rate is None else request_rate,
        **run.summary(),
    }
    summary = _json_safe(summary)
    print(format_table(summary, title=f"{args.workload} / {args.endpoint} / {model}"))
    if args.output_json is not None:
        config_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        document: dict[str, Any] = {"config": config_json, "summary": summary}
        if args.save_requests:
            document["requests"] = [r.to_json() for r in run.results]
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(_json_safe(document), indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


def _json_safe(value: Any) -> Any:
    """JSON has no infinity: write it as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


if __name__ == "__main__":
    main()
