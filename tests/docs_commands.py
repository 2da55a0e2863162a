"""Run the commands in README.md and docs/*.md against a clone with nothing beside it.

    python -m tests.docs_commands            # the fast blocks (what CI runs, through pytest)
    python -m tests.docs_commands --slow     # every runnable block, `make serve` started for some
    python -m tests.docs_commands --list     # every command block and how it is marked

Every fenced block of commands (```sh, ```bash, ```shell, ```console, ```python) carries a marker
on the line before its fence (tests/test_docs_commands.py fails on a block without one):

    <!-- runnable -->               cheap: run by `make test` (CI) and `make docs-check`
    <!-- runnable: slow -->         minutes or more (benchmarks, the whole test suite, installs):
                                    only with --slow (`make docs-check-all`)
    <!-- runnable: slow, server --> as slow, and needs the service up: the check starts
                                    `make serve` in the clone first and stops it at the end
    <!-- not runnable: REASON -->   needs what no clone has (Docker, a Kubernetes cluster, a GPU,
                                    a server that is not ours), or only illustrates

Blocks without a language (diagrams, formulas, usage synopses) are not commands.

How a block runs: in a fresh ``git clone`` of this repository in a new temporary directory (so
there is no ``../shared`` beside it), over which the working tree's uncommitted changes are
copied (``--head`` skips that); ``.venv`` in the clone is a link to the virtualenv already built
(``--venv``, default: this interpreter's), whose Makefile stamp is made to look current so that
no ``make`` target reinstalls anything. Shell blocks run with ``bash -e -o pipefail`` and
Python blocks with ``python -``, in the clone's root, with the venv activated (first on PATH,
``VIRTUAL_ENV`` set) as the docs assume, ``KUBERAY_CRD_PATH`` unset (a user's clone has no CRD)
and ``PREFIXSERVE_IN_DOCS_CHECK=1`` (the docs test skips itself when ``make test`` runs inside
a check). Blocks run in document order, README.md first, the server blocks last (one `make
serve` for all of them), so a block may use a file that an earlier block of its tier, or a fast
block, wrote. Each block runs in a shell of its own: no variables carry over.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = {"sh", "bash", "shell", "console", "python"}
FAST, SLOW, SERVER, NOT_RUNNABLE = "fast", "slow", "server", "not runnable"
NESTED_ENV = "PREFIXSERVE_IN_DOCS_CHECK"
FAST_TIMEOUT_S = 600.0
SLOW_TIMEOUT_S = 4 * 3600.0
SERVER_START_TIMEOUT_S = 1200.0

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*(runnable|not runnable)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced command block: where it is, its language and body, and its marker (``kind`` is
    fast, slow, server or not runnable; None where it has no marker)."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    body: str
    kind: str | None
    reason: str = ""

    def where(self, root: Path = ROOT) -> str:
        with contextlib.suppress(ValueError):
            return f"{self.path.relative_to(root)}:{self.line}"
        return f"{self.path}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.kind in (FAST, SLOW, SERVER)


class MarkerError(ValueError):
    pass


def _kind(match: re.Match[str], where: str) -> tuple[str, str]:
    word, arg = match.group(1), (match.group(2) or "").strip()
    if word == "not runnable":
        if not arg:
            raise MarkerError(f"{where}: `not runnable` needs a reason after the colon")
        return NOT_RUNNABLE, arg
    options = {a.strip() for a in arg.split(",") if a.strip()}
    if not options <= {SLOW, SERVER}:
        raise MarkerError(f"{where}: unknown runnable option(s) {sorted(options - {SLOW, SERVER})}")
    if SERVER in options:
        if SLOW not in options:
            raise MarkerError(f"{where}: a server block is slow: `runnable: slow, server`")
        return SERVER, ""
    return (SLOW if SLOW in options else FAST), ""


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of ``path`` whose language is a command language, with its marker
    (the nearest non-blank line before the fence, if it is one)."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, language = match.groups()
        start = i
        end = start + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[:3]):
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[start + 1 : end]) + "\n"
        i = end + 1
        if language.lower() not in COMMAND_LANGUAGES:
            continue
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = _MARKER.match(lines[prev]) if prev >= 0 else None
        where = f"{path}:{start + 1}"
        kind, reason = _kind(marker, where) if marker else (None, "")
        blocks.append(Block(path, start + 1, language.lower(), body, kind, reason))
    return blocks


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for path in doc_files(root) for b in parse_blocks(path)]


# --- the clone -----------------------------------------------------------------------------------


def default_venv() -> Path:
    """This interpreter's virtualenv, else the checkout's .venv."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix).resolve()
    return ROOT / ".venv"


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def make_clone(dest_parent: Path, venv: Path, *, head_only: bool = False) -> Path:
    """A clone of this repository at ``dest_parent/prefixserve`` (nothing beside it), with the
    working tree's changes copied over unless ``head_only``, and ``.venv`` linked to ``venv``."""
    stamp = venv / ".installed"
    if not (venv / "bin" / "python").exists():
        raise FileNotFoundError(f"no virtualenv at {venv}: run `make venv` first")
    if not stamp.exists():
        raise FileNotFoundError(f"{stamp} is missing: run `make venv` so the venv is complete")
    clone = dest_parent / "prefixserve"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    if not head_only:
        # What a commit of the working tree would hold: tracked files as they are now, new files
        # that are not ignored, and no deleted ones.
        listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
        for name in filter(None, listed.split("\0")):
            src, dst = ROOT / name, clone / name
            if src.is_symlink() or src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                if dst.is_symlink() or dst.exists():
                    dst.unlink()
                shutil.copy2(src, dst, follow_symlinks=False)
        for name in filter(None, _git("ls-files", "-z", "--deleted", cwd=ROOT).split("\0")):
            with contextlib.suppress(FileNotFoundError):
                (clone / name).unlink()
    link = clone / ".venv"
    if link.is_symlink() or link.is_file():
        link.unlink()  # a checkout whose own .venv is a link copies that link over
    link.symlink_to(venv.resolve(), target_is_directory=True)
    # The stamp depends on these two: older than it, `make` sees the venv as built.
    done = stamp.stat().st_mtime
    for name in ("Makefile", "pyproject.toml"):
        os.utime(clone / name, (done - 1, done - 1))
    return clone


def block_env(clone: Path) -> dict[str, str]:
    env = dict(os.environ)
    venv = clone / ".venv"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    # Not a user's: an outer make's flags and command-line variables (VENV=..., say) would
    # reach a `make` in a block; nor is a CRD path beside a user's clone.
    for name in (
        "PYTHONHOME",
        "KUBERAY_CRD_PATH",
        "MAKEFLAGS",
        "MFLAGS",
        "MAKELEVEL",
        "MAKEOVERRIDES",
    ):
        env.pop(name, None)
    env[NESTED_ENV] = "1"
    return env


# --- running ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    block: Block
    ok: bool
    seconds: float
    output: str


def run_block(block: Block, clone: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    if block.language == "python":
        cmd = [str(clone / ".venv" / "bin" / "python"), "-"]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.body]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            cwd=clone,
            env=env,
            input=block.body if block.language == "python" else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
            start_new_session=True,
        )
        ok, output = proc.returncode == 0, proc.stdout
        if not ok:
            output += f"\n[exit status {proc.returncode}]"
    except subprocess.TimeoutExpired as e:
        out = e.output if isinstance(e.output, str) else (e.output or b"").decode(errors="replace")
        ok, output = False, f"{out}\n[timed out after {timeout_s:.0f} s]"
    return Outcome(block, ok, time.monotonic() - started, output)


@contextlib.contextmanager
def make_serve(clone: Path, env: dict[str, str], log_path: Path) -> Iterator[None]:
    """`make serve` in the clone, in a session of its own, until it answers a completion; stopped
    with everything it started on the way out (benchmarks.servers does both)."""
    from benchmarks import servers

    spec = servers.read_serve_config(clone / "serve_config.yaml")
    if servers.port_in_use(spec.host, spec.port):
        raise RuntimeError(
            f"{spec.base_url} is in use: stop that server first (the docs check starts its own)"
        )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["make", "serve"],
            cwd=clone,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = servers.ServerProcess(
        "make serve", proc, spec.base_url, spec.served_model_name, log_path, time.monotonic()
    )
    try:
        servers.wait_ready(server, SERVER_START_TIMEOUT_S)
        yield
    finally:
        servers.stop(server)


def select(blocks: Sequence[Block], slow: bool) -> list[Block]:
    """The blocks to run, in order: fast (and with ``slow`` slow) blocks in document order, then
    (with ``slow``) the server blocks in document order, so that one `make serve` serves them
    all and no benchmark of the others runs beside it."""
    if not slow:
        return [b for b in blocks if b.kind == FAST]
    return [b for b in blocks if b.kind in (FAST, SLOW)] + [b for b in blocks if b.kind == SERVER]


def run_check(
    *,
    slow: bool = False,
    venv: Path | None = None,
    head_only: bool = False,
    keep: bool = False,
    only: str | None = None,
) -> list[Outcome]:
    """Run the selected blocks in a new clone; every outcome, in order. ``only``: blocks whose
    location (``docs/routing.md:144``) contains it. Progress goes to stderr."""
    blocks = select(all_blocks(), slow)
    if only:
        blocks = [b for b in blocks if only in b.where()]
    tmp = Path(tempfile.mkdtemp(prefix="docs-check-"))
    outcomes: list[Outcome] = []
    try:
        clone = make_clone(tmp, venv or default_venv(), head_only=head_only)
        env = block_env(clone)
        with contextlib.ExitStack() as stack:
            serving = False
            for block in blocks:
                if block.kind == SERVER and not serving:
                    print("  starting make serve in the clone", file=sys.stderr, flush=True)
                    stack.enter_context(make_serve(clone, env, tmp / "make-serve.log"))
                    serving = True
                timeout = FAST_TIMEOUT_S if block.kind == FAST else SLOW_TIMEOUT_S
                outcome = run_block(block, clone, env, timeout)
                outcomes.append(outcome)
                status = "ok" if outcome.ok else "FAILED"
                print(
                    f"  {block.where()} [{block.kind}] {status} ({outcome.seconds:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                if not outcome.ok:
                    print(_indent(outcome.output[-4000:]), file=sys.stderr, flush=True)
    finally:
        if keep:
            print(f"  kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return outcomes


def _indent(text: str) -> str:
    return "\n".join("    | " + line for line in text.rstrip().splitlines())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.docs_commands", description=__doc__.split("\n")[0]
    )
    p.add_argument("--slow", action="store_true", help="also the slow and server blocks")
    p.add_argument("--list", action="store_true", help="list the blocks and their markers")
    p.add_argument("--only", default=None, help="blocks whose file:line contains this")
    p.add_argument("--venv", type=Path, default=None, help="virtualenv to link as .venv")
    p.add_argument("--head", action="store_true", help="HEAD only: no uncommitted changes")
    p.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = p.parse_args(argv)
    blocks = all_blocks()
    if args.list:
        for b in blocks:
            first = next((line for line in b.body.splitlines() if line.strip()), "")
            note = f" ({b.reason})" if b.reason else ""
            print(f"{b.where():28} {b.kind or 'UNMARKED':13} {first[:60]}{note}")
        return 0
    unmarked = [b.where() for b in blocks if b.kind is None]
    if unmarked:
        print(f"command blocks without a marker: {', '.join(unmarked)}", file=sys.stderr)
        return 2
    outcomes = run_check(
        slow=args.slow, venv=args.venv, head_only=args.head, keep=args.keep, only=args.only
    )
    failed = [o for o in outcomes if not o.ok]
    skipped = len([b for b in blocks if not b.runnable]) + len(
        [b for b in blocks if b.runnable and b not in {o.block for o in outcomes}]
    )
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
