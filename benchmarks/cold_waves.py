"""Cold bursts against our server and ``vllm serve`` in turn, both up at once.

    python -m benchmarks.cold_waves                       # 8 waves each, shared-prefix bursts
    python -m benchmarks.cold_waves --kind random --waves 6
    python -m benchmarks.cold_waves --config my_config.yaml --skip-vllm

What sets the TTFT p99 of ``benchmarks.compare_serving``'s workloads is the first, cold wave of
concurrent requests: nothing is cached and every prompt waits for the prefill of the ones ahead
of it. Its rounds run one server after the other, minutes apart, on a machine whose speed drifts
by up to 2x within minutes, so a difference of a few hundred ms there is as likely the machine
as the server. Here both servers stay up (an idle server costs little CPU) and waves go to each
in turn, the order swapped every wave, so each pair of waves meets the machine in one state.

A wave is ``--concurrency`` streamed completions sent at once, with prompts of fresh random
token ids (nothing cached from earlier waves):

* ``prefix``: 8 prompts, 4 fresh 512-token prefixes, each + 32 fresh tokens (two prompts per
  prefix), 32 tokens out: the cold start of ``prefix_repetition``;
* ``random``: 32 prompts of 100 tokens, 32 out: the cold start of ``random``.

Each request's TTFT is taken at its first chunk with text, as vLLM's serving client takes it.
Printed per wave: the slowest request's TTFT (the wave's max, what p99 comes from) and the
median; then, per server, the medians of both over the waves, and vLLM's over ours. vLLM is set
up as ``benchmarks.compare_serving`` sets it up (``benchmarks.servers``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks import servers
from benchmarks.client import ClientConfig, stream_request
from benchmarks.metrics import RequestResult
from benchmarks.workloads import DEFAULT_VOCAB_SIZE, WorkloadRequest, safe_id_range

KINDS = ("prefix", "random")


@dataclass(frozen=True)
class WaveShape:
    prompts: int
    prefixes: int  # 0: no shared prefix
    prefix_len: int
    suffix_len: int
    output_len: int


SHAPES = {
    "prefix": WaveShape(prompts=8, prefixes=4, prefix_len=512, suffix_len=32, output_len=32),
    "random": WaveShape(prompts=32, prefixes=0, prefix_len=0, suffix_len=100, output_len=32),
}


def wave_requests(
    shape: WaveShape, rng: np.random.Generator, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[WorkloadRequest]:
    """One wave's prompts, all ids drawn fresh from ``rng``: prompt ``i`` is prefix ``i mod
    prefixes`` (when there are prefixes) followed by its own ``suffix_len`` ids."""
    low, high = safe_id_range(vocab_size)
    prefixes = [rng.integers(low, high, shape.prefix_len).tolist() for _ in range(shape.prefixes)]
    out = []
    for i in range(shape.prompts):
        head = prefixes[i % shape.prefixes] if prefixes else []
        ids = head + rng.integers(low, high, shape.suffix_len).tolist()
        out.append(WorkloadRequest(ids, shape.output_len, shared_prefix_len=len(head)))
    return out


@dataclass
class Wave:
    server: str
    index: int
    ttfts_ms: list[float]
    errors: list[str] = field(default_factory=list)

    @property
    def max_ms(self) -> float:
        return max(self.ttfts_ms) if self.ttfts_ms else float("nan")

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.ttfts_ms) if self.ttfts_ms else float("nan")


def summarize(waves: list[Wave]) -> dict[str, dict[str, float]]:
    """Per server: the median over its waves of the wave's max and of its median TTFT, and the
    number of failed requests."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(w.server for w in waves):
        mine = [w for w in waves if w.server == name and w.ttfts_ms]
        out[name] = {
            "waves": len(mine),
            "median_wave_max_ms": statistics.median(w.max_ms for w in mine) if mine else 0.0,
            "median_wave_p50_ms": statistics.median(w.p50_ms for w in mine) if mine else 0.0,
            "failed": sum(len(w.errors) for w in waves if w.server == name),
        }
    return out


async def run_wave(
    base_url: str, model: str, requests: list[WorkloadRequest], server: str, index: int
) -> Wave:
    config = ClientConfig(base_url=base_url, model=model, ignore_eos=True)
    results = [RequestResult(i) for i in range(len(requests))]
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        await asyncio.gather(
            *(
                stream_request(client, config, r, res)
                for r, res in zip(requests, results, strict=True)
            )
        )
    wave = Wave(server, index, [])
    for res in results:
        if res.outcome == "ok" and res.ttft is not None:
            wave.ttfts_ms.append(res.ttft * 1e3)
        else:
            wave.errors.append(res.error or "no content")
    return wave


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", type=Path, default=servers.DEFAULT_CONFIG, help="our Serve config")
    ap.add_argument("--kind", choices=KINDS, default="prefix")
    ap.add_argument("--waves", type=int, default=8, help="waves per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause-s", type=float, default=1.0, help="idle time between waves")
    ap.add_argument("--skip-vllm", action="store_true", help="run only our server")
    ap.add_argument("--vllm-port", type=int, default=8001)
    ap.add_argument("--venv", type=Path, default=None, help="vLLM's virtualenv")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for every wave")
    args = ap.parse_args(argv)
    if args.waves < 1:
        ap.error("--waves: must be >= 1")

    from engine.model.loader import resolve_model

    spec = servers.read_serve_config(args.config)
    model_dir = resolve_model(spec.model)
    starters = {}
    if not args.skip_vllm:
        vspec = servers.vllm_spec_for(spec, model_dir, port=args.vllm_port, venv=args.venv)
        starters["vllm"] = lambda log: servers.start_vllm(vspec, log)
    starters["ours"] = lambda log: servers.start_ours(spec, log)
    work = Path(tempfile.mkdtemp(prefix="cold_waves-"))
    print(f"server logs: {work}", flush=True)
    rng = np.random.default_rng(args.seed)
    shape = SHAPES[args.kind]
    running: dict[str, servers.ServerProcess] = {}
    waves: list[Wave] = []
    try:
        for name, start in starters.items():
            running[name] = start(work / f"cold_waves-{name}.log")
            ready_s = servers.wait_ready(running[name], 900 if name == "vllm" else 300)
            print(f"{name} ready in {ready_s:.0f} s", flush=True)
        for name, server in running.items():  # the same small warm-up for each
            warm = wave_requests(SHAPES["random"], rng)[:4]
            asyncio.run(run_wave(server.base_url, server.model, warm, name, -1))
        names = list(running)
        for i in range(args.waves):
            for name in names if i % 2 == 0 else names[::-1]:
                server = running[name]
                wave = asyncio.run(
                    run_wave(server.base_url, server.model, wave_requests(shape, rng), name, i)
                )
                waves.append(wave)
                print(
                    f"wave {i} {name:5s} max {wave.max_ms:7.0f} ms  p50 {wave.p50_ms:7.0f} ms"
                    + (f"  failed {len(wave.errors)}" if wave.errors else ""),
                    flush=True,
                )
                time.sleep(args.pause_s)
    finally:
        for server in running.values():
            servers.stop(server)
    summary = summarize(waves)
    for name, s in summary.items():
        print(
            f"{name}: median over {s['waves']} waves of the wave's max TTFT "
            f"{s['median_wave_max_ms']:.0f} ms, of its median {s['median_wave_p50_ms']:.0f} ms, "
            f"failed {s['failed']}"
        )
    if "ours" in summary and "vllm" in summary and summary["ours"]["median_wave_max_ms"] > 0:
        ratio = summary["vllm"]["median_wave_max_ms"] / summary["ours"]["median_wave_max_ms"]
        print(f"wave max, vLLM / ours: {ratio:.2f}x (> 1: ours is faster)")
    result = {"kind": args.kind, "waves": [asdict(w) for w in waves], "summary": summary}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
