"""CPU seconds per process of ``make serve``'s stack, idle and under one ``random`` client run.

    python -m benchmarks.process_cpu                          # 60 s idle, then one random run
    python -m benchmarks.process_cpu --env RAY_FOO=1 --out results/cpu.json
    python -m benchmarks.process_cpu --idle-s 30 --no-load

Starts our server as ``benchmarks.compare_serving`` does (``serve run CONFIG --address local`` in
the Makefile's environment, in a session of its own), plus any ``--env NAME=VALUE`` (which win
over the Makefile's), waits until it serves and a settling period has passed, then reads every
process's user + system CPU time (psutil) at three points: before and after ``--idle-s`` seconds
with no requests, and after one run of ``benchmarks.serve`` with ``random`` prompts shaped like
compare_serving's ``random`` workload (64 prompts of 100 token ids, 128 out with ``ignore_eos``,
concurrency 32). Then it stops the server and prints a table of CPU-s per process (Ray's
processes named by role: ``gcs_server``, ``raylet``, ``dashboard``, ``ray::ServeController``,
...), the rest of the machine as ``other``, and the client's throughput.

A process that starts between two readings counts from zero; one that exits in between is lost
(the stack starts nothing once it serves, so neither happens in a steady state).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from benchmarks import servers

# Substrings of a command line -> the name a row gets (first match wins). Ray's workers set their
# process title to ``ray::<actor class>``; Serve's replicas to ``ray::ServeReplica:<app>:<dep>``.
ROLES: tuple[tuple[str, str], ...] = (
    ("gcs_server", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard/agent.py", "dashboard agent"),
    ("dashboard/dashboard.py", "dashboard"),
    ("runtime_env/agent/main.py", "runtime_env agent"),
    ("log_monitor.py", "log_monitor"),
    ("monitor.py", "monitor"),
    ("haproxy", "haproxy"),
    ("serve run", "serve run (driver)"),
    ("benchmarks.serve", "client"),
)

Snapshot = dict[int, tuple[str, float]]
MACHINE = -1  # the snapshot key of the machine-wide busy time


def role(proc: psutil.Process) -> str:
    """A row name for ``proc``: its Ray role, else its executable's name."""
    try:
        cmdline = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"
    if cmdline.startswith("ray::"):
        # ray::ServeReplica:prefixserve:Engine, ray::ServeController, ray::IDLE, ...
        return cmdline.split()[0]
    for needle, label in ROLES:
        if needle in cmdline:
            return label
    return name


def session_of(pid: int) -> int:
    """The session id of ``pid`` (field 6 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[3])


def snapshot(session: int) -> Snapshot:
    """pid -> (row name, CPU-s so far) of every live process; those outside the server's
    session (and not the client) are named ``other``."""
    out: Snapshot = {}
    for proc in psutil.process_iter():
        try:
            times = proc.cpu_times()
            cpu = times.user + times.system
            sid = session_of(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        name = role(proc)
        if sid != session and name != "client":
            name = "other"
        out[proc.pid] = (name, cpu)
    out[MACHINE] = ("machine busy", machine_busy())
    return out


def machine_busy() -> float:
    """CPU-s the whole machine has spent busy (not idle, iowait or stolen) since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)


def delta(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU-s per row name between two snapshots (a pid's first reading counts from zero).

    The ``machine busy`` row is the whole machine's, processes that came and went between the
    snapshots included."""
    rows: dict[str, float] = defaultdict(float)
    for pid, (name, cpu) in after.items():
        if pid == MACHINE:
            continue
        start = before.get(pid, (name, 0.0))[1]
        rows[name] += max(cpu - start, 0.0)
    rows["machine busy"] = after[MACHINE][1] - before[MACHINE][1]
    return dict(rows)


def client_argv(base_url: str, result: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.serve",
        *("--base-url", base_url, "--workload", "random"),
        *("--num-prompts", "64", "--input-len-min", "100", "--input-len-max", "100"),
        *("--output-len", "128", "--ignore-eos", "--concurrency", "32", "--temperature", "0"),
        *("--seed", "0", "--disable-tqdm", "--output-json", str(result)),
    ]


def format_rows(idle: dict[str, float], load: dict[str, float] | None, idle_s: float) -> str:
    names = sorted(set(idle) | set(load or {}), key=lambda n: -(load or idle).get(n, 0.0))
    lines = [f"{'process':<44} {'idle CPU-s':>10} {'idle cores':>10} {'load CPU-s':>10}"]
    for name in names:
        load_cell = f"{load.get(name, 0.0):>10.2f}" if load is not None else f"{'':>10}"
        lines.append(
            f"{name:<44} {idle.get(name, 0.0):>10.2f} {idle.get(name, 0.0) / idle_s:>10.3f} "
            f"{load_cell}"
        )
    return "\n".join(lines)


def not_engine(rows: dict[str, float]) -> float:
    """CPU-s of the stack without the engine replicas, the client and the rest of the machine."""
    skip = ("ServeReplica", "client", "other", "machine busy")
    return sum(v for k, v in rows.items() if not any(s in k for s in skip))


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env expects NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.process_cpu", description=__doc__)
    parser.add_argument("--config", type=Path, default=servers.DEFAULT_CONFIG)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--settle-s", type=float, default=65.0)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--no-load", action="store_true", help="skip the client run")
    parser.add_argument("--ready-timeout-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from engine.model.loader import resolve_model

    spec = servers.read_serve_config(args.config)
    resolve_model(spec.model)
    extra = parse_env(args.env)
    work = Path(tempfile.mkdtemp(prefix="process-cpu-"))
    servers.wait_port_free(spec.host, spec.port, 120.0)
    env = {**servers.server_env(), **extra}
    server = servers.launch(
        "ours",
        servers.ours_command(spec),
        env,
        spec.base_url,
        spec.served_model_name,
        work / "server.log",
    )
    result: dict[str, Any] = {"env": extra, "config": str(args.config), "idle_s": args.idle_s}
    try:
        result["ready_s"] = servers.wait_ready(server, args.ready_timeout_s)
        time.sleep(args.settle_s)
        sid = server.proc.pid
        t0, s0 = time.monotonic(), snapshot(sid)
        time.sleep(args.idle_s)
        t1, s1 = time.monotonic(), snapshot(sid)
        result["idle"] = delta(s0, s1)
        result["idle_wall_s"] = t1 - t0
        if not args.no_load:
            client_json = work / "client.json"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(
                client_argv(spec.base_url, client_json),
                check=True,
                cwd=servers.ROOT,
                stdout=subprocess.DEVNULL,
            )
            t2, s2 = time.monotonic(), snapshot(sid)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            result["load"] = delta(s1, s2)
            result["load"]["client"] = (after.ru_utime + after.ru_stime) - (
                before.ru_utime + before.ru_stime
            )
            result["load_wall_s"] = t2 - t1
            summary = json.loads(client_json.read_text())["summary"]
            result["client"] = {
                k: summary[k]
                for k in ("completed", "failed", "duration_s", "output_token_throughput")
            }
            result["client"]["ttft_p50_ms"] = summary["ttft_ms"]["p50"]
            result["client"]["tpot_p50_ms"] = summary["tpot_ms"]["p50"]
    finally:
        servers.stop(server)
    print(format_rows(result["idle"], result.get("load"), result["idle_wall_s"]))
    print(f"stack without engine replicas: idle {not_engine(result['idle']):.2f} CPU-s", end="")
    if "load" in result:
        print(f", load {not_engine(result['load']):.2f} CPU-s over {result['load_wall_s']:.1f} s")
        print("client:", json.dumps(result["client"]))
    else:
        print()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"server log: {work / 'server.log'}")
    return result


if __name__ == "__main__":
    main()
