"""Our server vs ``vllm serve`` over HTTP, measured by vLLM's own serving benchmark client.

    python -m benchmarks.compare_serving                       # 3 rounds, all three workloads
    python -m benchmarks.compare_serving --rounds 1 --workloads random --num-prompts-scale 0.25
    python -m benchmarks.compare_serving --config my_config.yaml --out results.json

Each round starts our server (``serve run CONFIG`` in ``make serve``'s environment: the
Makefile's ``export`` lines, see ``benchmarks.servers``; always in a Ray cluster of its own, never
one already running on the machine), runs a short warmup and every workload
against it, stops it, then does the same with vLLM's OpenAI server; the order alternates from
round to round, so a drift in a shared machine's speed hits both alike. One server runs at a
time. Printed per workload: the median over the rounds of output tok/s, TTFT and TPOT (p50,
p99) and failed requests for each server, and their ratios, oriented so that > 1 means ours is
better (ours/vLLM for throughput, vLLM/ours for latencies). Everything, per-round results
included, goes to a JSON file (``--out``, else a temporary directory, whose path is printed, that
also holds the servers' and the client's logs).

The client is ``vllm.benchmarks.serve`` run inside vLLM's virtualenv (``benchmarks.compare_vllm``
installs it once into ``~/.cache/prefixserve/vllm-venv``, and this adds pandas, which the
client's ``custom`` dataset needs; its ``vllm`` command is broken, so the module is called
directly), with identical arguments for both servers: greedy
(``--temperature 0``), ``--ignore-eos``, ``--seed 0``. Workloads (``benchmarks.serving_workloads``):

* ``random``: 64 prompts of 100 random tokens, 128 out, concurrency 32 (no sharing);
* ``prefix_repetition``: 8 prefixes of 512 tokens, each prompt one of them + 32 tokens, 32 out,
  96 prompts, concurrency 8;
* ``multi_turn``: 16 chats x 6 turns through ``/v1/chat/completions``, each turn's prompt the
  previous one + an answer + a question, 32-64 out, concurrency 8.

vLLM runs ``python -m vllm.entrypoints.openai.api_server`` on the model our config serves
(the HF directory ``engine.model.loader.resolve_model`` converts it into), in the dtype our
config resolves to on this machine (``auto``: bfloat16 with native bf16, else float32), with
prefix caching, ``--max-model-len 2048``, ``VLLM_CPU_KVCACHE_SPACE=4``, its OpenMP threads bound
to every CPU of this process, and the system's tcmalloc preloaded as vLLM's CPU guide advises.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import servers
from benchmarks.serving_workloads import WARMUPS, WORKLOAD_NAMES, workload_args

CLIENT_CODE = """\
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))
"""

# Reported name -> key in vLLM's result JSON. Latencies in ms.
METRICS: dict[str, str] = {
    "output_tok_s": "output_throughput",
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
    "failed": "failed",
    "completed": "completed",
}
HIGHER_IS_BETTER = {"output_tok_s"}
RATIO_METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
SERVER_NAMES = {"ours": "ours", "vllm": "vLLM"}


@dataclass
class RunResult:
    """One workload against one server in one round."""

    server: str  # "ours" or "vllm"
    round: int
    workload: str
    metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkloadSummary:
    """Medians over the rounds per server, and ratios (> 1: ours is better)."""

    workload: str
    rounds: int
    ours: dict[str, float]
    vllm: dict[str, float]
    ratios: dict[str, float]


def extract_metrics(raw: dict[str, Any]) -> dict[str, float]:
    return {name: float(raw[key]) for name, key in METRICS.items() if raw.get(key) is not None}


def medians(runs: list[RunResult]) -> dict[str, float]:
    names = {name for r in runs for name in r.metrics}
    return {
        name: statistics.median(r.metrics[name] for r in runs if name in r.metrics)
        for name in sorted(names)
    }


def ratio(metric: str, ours: float, vllm: float) -> float | None:
    """ours/vLLM for throughput, vLLM/ours for latencies: > 1 means ours is better."""
    num, den = (ours, vllm) if metric in HIGHER_IS_BETTER else (vllm, ours)
    return num / den if den > 0 else None


def summarize(runs: list[RunResult], workloads: list[str]) -> list[WorkloadSummary]:
    out = []
    for w in workloads:
        ok = [r for r in runs if r.workload == w and r.error is None]
        ours = medians([r for r in ok if r.server == "ours"])
        vllm = medians([r for r in ok if r.server == "vllm"])
        ratios = {}
        for m in RATIO_METRICS:
            if m in ours and m in vllm and (value := ratio(m, ours[m], vllm[m])) is not None:
                ratios[m] = value
        rounds = len({r.round for r in ok})
        out.append(WorkloadSummary(w, rounds, ours, vllm, ratios))
    return out


def format_table(summaries: list[WorkloadSummary]) -> str:
    columns = [
        ("output_tok_s", "out tok/s"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("tpot_p50_ms", "TPOT p50 ms"),
        ("tpot_p99_ms", "TPOT p99 ms"),
        ("failed", "failed"),
    ]
    lines = [
        "Medians over rounds. ratio: ours/vLLM for throughput, vLLM/ours for latencies "
        "(> 1: ours is better).",
        "",
        "| workload | server | " + " | ".join(title for _, title in columns) + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    for s in summaries:
        for label, values in (("ours", s.ours), ("vLLM", s.vllm)):
            if values:
                cells = [_cell(values.get(m), m) for m, _ in columns]
                lines.append(f"| {s.workload} | {label} | " + " | ".join(cells) + " |")
        if s.ratios:
            cells = [f"{s.ratios[m]:.2f}x" if m in s.ratios else "" for m, _ in columns]
            lines.append(f"| {s.workload} | ratio | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if metric == "failed" else f"{value:.1f}"


# --- running ------------------------------------------------------------------------------------


def client_argv(
    base_url: str, model: str, tokenizer: Path, result_dir: Path, filename: str, extra: list[str]
) -> list[str]:
    """Arguments for vLLM's serving benchmark: the common ones, then ``extra`` (the
    workload's), whose own ``--seed`` replaces the common ``--seed 0``."""
    seed = [] if "--seed" in extra else ["--seed", "0"]
    return [
        *("--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer)),
        *("--save-result", "--result-dir", str(result_dir), "--result-filename", filename),
        "--save-detailed",  # per-request TTFTs in the raw results, to see which requests set p99
        *seed,
        *("--temperature", "0", "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        *extra,
    ]


def run_client(py: Path, argv: list[str], result_path: Path, log_path: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "ab") as log:
        log.write(f"\n$ vllm bench serve {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.run(
            [str(py), "-c", CLIENT_CODE, *argv], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM's client failed ({proc.returncode}); log {log_path}:\n{tail}")
    return json.loads(result_path.read_text())


def measure(
    server: servers.ServerProcess,
    name: str,
    rnd: int,
    workloads: dict[str, list[str]],
    py: Path,
    tokenizer: Path,
    work: Path,
) -> list[RunResult]:
    """The warmups, then every workload, against a ready server; a failed client run is
    recorded with its error and the next one runs."""
    results = []
    client_log = work / f"client-{name}-r{rnd}.log"
    for wname, wargs in [*WARMUPS.items(), *workloads.items()]:
        filename = f"{name}-r{rnd}-{wname}.json"
        argv = client_argv(server.base_url, server.model, tokenizer, work, filename, wargs)
        start = time.monotonic()
        result = RunResult(name, rnd, wname)
        try:
            result.raw = run_client(py, argv, work / filename, client_log)
            result.metrics = extract_metrics(result.raw)
        except RuntimeError as e:
            result.error = str(e)
        result.wall_s = round(time.monotonic() - start, 1)
        if wname in WARMUPS:
            if result.error:
                print(f"  {wname} failed: {result.error}", flush=True)
            continue
        results.append(result)
        shown = {k: round(v, 1) for k, v in result.metrics.items()}
        print(f"  {wname}: {result.error or shown}", flush=True)
    return results


def machine_info() -> dict[str, Any]:
    from engine.cpuinfo import cpu_flags, cpu_model_name

    flags = cpu_flags()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {
        "cpu_model": cpu_model_name(),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_start": load,
    }


def vllm_version(py: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", type=Path, default=servers.DEFAULT_CONFIG, help="our Serve config")
    ap.add_argument("--workloads", default=",".join(WORKLOAD_NAMES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--num-prompts-scale", type=float, default=1.0, help="shrink workloads for smoke runs"
    )
    ap.add_argument("--vllm-port", type=int, default=8001)
    ap.add_argument("--venv", type=Path, default=None, help="vLLM's virtualenv")
    ap.add_argument("--vllm-tcmalloc", default="auto", help="auto, none or a path")
    ap.add_argument("--vllm-kv-space-gb", type=float, default=4)
    ap.add_argument("--ours-timeout", type=float, default=300, help="seconds to become ready")
    ap.add_argument("--vllm-timeout", type=float, default=600, help="seconds to become ready")
    ap.add_argument(
        "--port-wait", type=float, default=900, help="seconds to wait for a busy port to free"
    )
    ap.add_argument(
        "--ray-stop-last-resort",
        action="store_true",
        help="run `ray stop --force` if our Ray processes survive SIGKILL (ends every Ray "
        "cluster on the machine)",
    )
    ap.add_argument("--skip-vllm", action="store_true", help="run only our server")
    ap.add_argument("--skip-ours", action="store_true", help="run only vLLM's server")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for all results")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]

    from engine.model.loader import resolve_model

    work = Path(tempfile.mkdtemp(prefix="compare_serving-"))
    print(f"logs and raw results: {work}", flush=True)
    spec = servers.read_serve_config(args.config)
    model_dir = resolve_model(spec.model)  # converted once up front, as `make serve` does
    vspec = servers.vllm_spec_for(
        spec,
        model_dir,
        port=args.vllm_port,
        venv=args.venv,
        tcmalloc=args.vllm_tcmalloc,
        kv_space_gb=args.vllm_kv_space_gb,
    )
    py, dtype = vspec.python, vspec.dtype
    extra = {w: workload_args(w, work, args.num_prompts_scale) for w in workloads}
    meta: dict[str, Any] = {
        **machine_info(),
        "config": str(spec.config_path),
        "model": spec.model,
        "served_model_name": spec.served_model_name,
        "model_dir": str(model_dir),
        "config_dtype": spec.dtype,
        "dtype": dtype,
        "vllm_version": vllm_version(py),
        "vllm_command": vspec.command(),
        "vllm_threads_bind": vspec.threads_bind,
        "vllm_ld_preload": vspec.ld_preload,
        "ours_env": {k: v for k, v in servers.server_env().items() if k.startswith("RAY")},
        "rounds": args.rounds,
        "num_prompts_scale": args.num_prompts_scale,
        "client_args": {w: extra[w] for w in workloads},
        "work_dir": str(work),
    }
    starters: dict[str, Callable[[Path], servers.ServerProcess]] = {}
    if not args.skip_ours:
        starters["ours"] = lambda log: servers.start_ours(spec, log)
    if not args.skip_vllm:
        starters["vllm"] = lambda log: servers.start_vllm(vspec, log)
    hosts = {"ours": (spec.host, spec.port), "vllm": ("127.0.0.1", vspec.port)}
    timeouts = {"ours": args.ours_timeout, "vllm": args.vllm_timeout}

    runs: list[RunResult] = []
    startup: list[dict[str, Any]] = []
    out = args.out or work / "compare_serving.json"
    t0 = time.monotonic()
    try:
        for rnd in range(args.rounds):
            order = list(starters) if rnd % 2 == 0 else list(starters)[::-1]
            for name in order:
                servers.wait_port_free(*hosts[name], timeout_s=args.port_wait)
                print(f"round {rnd + 1}: starting {SERVER_NAMES[name]}", flush=True)
                server = starters[name](work / f"server-{name}-r{rnd}.log")
                try:
                    ready_s = servers.wait_ready(server, timeouts[name])
                    startup.append({"server": name, "round": rnd, "ready_s": round(ready_s, 1)})
                    print(f"  ready in {ready_s:.0f} s", flush=True)
                    runs += measure(server, name, rnd, extra, py, model_dir, work)
                finally:
                    servers.stop(server, ray_stop_last_resort=args.ray_stop_last_resort)
    except BaseException as e:
        meta["aborted"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        summaries = summarize(runs, workloads)
        table = format_table(summaries)
        with open("/proc/loadavg") as f:
            meta["loadavg_end"] = f.read().split()[:3]
        meta["wall_s"] = round(time.monotonic() - t0)
        report = {
            "meta": meta,
            "startup": startup,
            "summary": [asdict(s) for s in summaries],
            "runs": [asdict(r) for r in runs],
            "table": table,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(
            f"\n{meta['cpu_model']} ({', '.join(meta['cpu_flags'])}), {meta['nproc']} CPUs, "
            f"load {' '.join(meta['loadavg_start'])}; {dtype}; vLLM {meta['vllm_version']}; "
            f"{args.rounds} round(s){' (aborted: partial)' if 'aborted' in meta else ''}\n"
        )
        print(table)
        print(f"\nresults: {out}", flush=True)
    return report


if __name__ == "__main__":
    main()
