"""Resolve the GPU extras as a Linux GPU machine's pip would, without installing anything.

``pip install --dry-run --report`` resolves the project's base dependencies plus an extra's, read
from pyproject.toml (with ``--only-binary=:all:`` pip cannot build the project itself), for
CPython 3.11 on manylinux x86-64, from PyPI alone. pip reads each wheel's metadata, not the
multi-GB CUDA wheels: PyPI serves the metadata on its own (PEP 658), and where an index or a
mirror does not, ``fast-deps`` reads it from the wheel with HTTP range requests. Then :func:`problems`
checks what pip picked against what the packages themselves declare: torch is a CUDA build and
transformers' own torch floor admits the torch that was resolved.

``python -m tests.packaging.gpu_resolve`` (``make gpu-resolve``) prints both resolutions and
exits non-zero on a problem.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPI = "https://pypi.org/simple"
GPU_EXTRAS = ("gpu", "gpu-vllm-flash-attn")
# The image's Python (rayproject/ray:*-py311-gpu).
PYTHON_VERSION = "3.11"
# The newest manylinux tag: glibc 2.35, Ubuntu 22.04, which Ray's images are built on (llguidance's
# wheels need manylinux_2_31).
GLIBC_MINOR = 35
# pip takes --platform literally: a wheel tagged only with an older manylinux tag (or a legacy
# alias) is a candidate only when that tag is named too.
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
# Settings pip may take from the environment that do not change what it resolves: TLS, timeouts.
_KEPT_PIP_ENV = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"}


class ResolutionError(RuntimeError):
    """pip found no set of wheels that satisfies the requirements."""


@dataclass(frozen=True)
class Resolved:
    """One distribution pip would install."""

    name: str  # canonical (PEP 503)
    version: Version
    url: str
    requires_dist: tuple[str, ...]


def requirements(extras: Iterable[str], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The base dependencies and those of ``extras``, as pip would install ``.[extras]``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    out = list(project["dependencies"])
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"pyproject.toml has no extra {extra!r} (it has {sorted(optional)})")
        out += optional[extra]
    return out


def pip_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``environ`` without the pip settings that add indexes, wheel directories or constraints
    (this machine's and CI's serve a CPU torch), and with no configuration file: PyPI only."""
    env = {k: v for k, v in environ.items() if not k.startswith("PIP_") or k in _KEPT_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_command(reqs: Iterable[str], report: Path, index_url: str = PYPI) -> list[str]:
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    return [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--report", str(report), "--python-version", PYTHON_VERSION, *platforms,
        "--only-binary=:all:", "--use-feature=fast-deps", "--index-url", index_url, *reqs,
    ]  # fmt: skip


def parse_report(report: Mapping) -> dict[str, Resolved]:
    """pip's installation report (``--report``, format version 1) by canonical name."""
    out: dict[str, Resolved] = {}
    for item in report["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        out[name] = Resolved(
            name=name,
            version=Version(meta["version"]),
            url=item["download_info"]["url"],
            requires_dist=tuple(meta.get("requires_dist") or ()),
        )
    return out


def resolve(
    reqs: Iterable[str], index_url: str = PYPI, timeout: float = 240
) -> dict[str, Resolved]:
    """What pip would install for ``reqs`` on the target platform; :class:`ResolutionError`
    with pip's own explanation where nothing fits."""
    reqs = list(reqs)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            pip_command(reqs, report, index_url),
            env=pip_env(), capture_output=True, text=True, timeout=timeout, cwd=tmp,
        )  # fmt: skip
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "fast-deps" not in line]
            raise ResolutionError(
                f"pip could not resolve {reqs} for CPython {PYTHON_VERSION} on manylinux "
                f"x86-64 from {index_url}:\n" + "\n".join(errors[-40:])
            )
        return parse_report(json.loads(report.read_text()))


def pypi_unreachable(index_url: str = PYPI, timeout: float = 10) -> str | None:
    """Why ``index_url`` cannot be read from here, or None when it can."""
    try:
        with urllib.request.urlopen(f"{index_url.rstrip('/')}/pip/", timeout=timeout):
            return None
    except OSError as exc:
        return f"{index_url} is unreachable ({exc})"


def _torch_floor_of(transformers: Resolved) -> Requirement | None:
    """transformers' own torch requirement (its `torch` extra): the version below which it
    disables torch at import."""
    for line in transformers.requires_dist:
        req = Requirement(line)
        if canonicalize_name(req.name) != "torch" or req.marker is None:
            continue
        if req.marker.evaluate({"extra": "torch"}) and not req.marker.evaluate({"extra": ""}):
            return req
    return None


def is_cuda_build(torch: Resolved, resolved: Mapping[str, Resolved]) -> bool:
    """PyPI's Linux torch depends on NVIDIA's CUDA wheels (directly, or through cuda-toolkit's
    extras); a CPU build (``+cpu``, from PyTorch's CPU index) has none."""
    cuda_deps = [r for r in torch.requires_dist if r.startswith(("nvidia-", "cuda-toolkit"))]
    nvidia = [n for n in resolved if n.startswith("nvidia-")]
    return bool(cuda_deps and nvidia) and torch.version.local is None


def problems(resolved: Mapping[str, Resolved]) -> list[str]:
    """What makes this set of wheels unfit for a GPU machine (empty: none)."""
    out: list[str] = []
    torch = resolved.get("torch")
    if torch is None:
        return ["torch was not resolved"]
    if not is_cuda_build(torch, resolved):
        out.append(f"torch {torch.version} is not a CUDA build ({torch.url})")
    transformers = resolved.get("transformers")
    if transformers is None:
        out.append("transformers was not resolved")
    else:
        floor = _torch_floor_of(transformers)
        if floor is None:
            out.append(f"transformers {transformers.version} declares no torch requirement")
        elif not floor.specifier.contains(torch.version, prereleases=True):
            out.append(
                f"transformers {transformers.version} needs {floor.name}{floor.specifier} and "
                f"disables torch {torch.version} at import"
            )
    return out


def describe(extra: str, resolved: Mapping[str, Resolved]) -> str:
    names = ("torch", "triton", "vllm-flash-attn", "transformers", "tokenizers", "huggingface-hub")
    found = ", ".join(f"{n} {resolved[n].version}" for n in names if n in resolved)
    cuda = sorted(n for n in resolved if n.startswith("nvidia-"))
    return f".[{extra}]: {found}; {len(cuda)} nvidia-* wheels; {len(resolved)} distributions"


def resolve_all(
    sets: Mapping[str, Iterable[str]], index_url: str = PYPI
) -> dict[str, dict[str, Resolved]]:
    """Each named set of requirements resolved on its own, concurrently (pip spends most of its
    time waiting on the index)."""
    with ThreadPoolExecutor(max_workers=max(1, len(sets))) as pool:
        futures = {name: pool.submit(resolve, reqs, index_url) for name, reqs in sets.items()}
        return {name: future.result() for name, future in futures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-url", default=PYPI, help="the index to resolve from (PyPI)")
    parser.add_argument("extras", nargs="*", default=list(GPU_EXTRAS))
    args = parser.parse_args(argv)
    failed = False
    sets = {extra: requirements([extra]) for extra in args.extras}
    try:
        resolutions = resolve_all(sets, args.index_url)
    except ResolutionError as exc:
        print(exc, file=sys.stderr)
        return 1
    for extra, resolved in resolutions.items():
        print(describe(extra, resolved))
        for problem in problems(resolved):
            print(f"  problem: {problem}")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
