"""A non-editable install (the container image's) must carry the files the code reads at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_kernel_sources_and_profile(tmp_path: Path) -> None:
    # Build from a copy of what the Dockerfile copies: setuptools writes build/ into the source.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("engine", "router", "deployments", "benchmarks"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("prefixserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    from benchmarks.sim.profile import DEFAULT_PROFILE
    from engine.kernels import native

    needed = [*native.SOURCES, *native.HEADERS, DEFAULT_PROFILE]
    missing = [str(p.relative_to(ROOT)) for p in needed if str(p.relative_to(ROOT)) not in names]
    assert not missing, missing
    # The `prefixserve` command is installed with the package.
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode().split("[console_scripts]")[1]
    assert "prefixserve = deployments.cli:main" in scripts
