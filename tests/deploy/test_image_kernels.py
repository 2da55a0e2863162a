"""The image can build the native kernels, and its build stops if they cannot be loaded there.

No Docker: the Dockerfile is parsed, and the check it runs at build time is run here, as is and
in the conditions of an image without a compiler or with the kernels switched off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import dockerfile
from tests.deploy.rayservice import ROOT

# Ray's images run as this user; the engine and its kernel cache belong to it.
BASE_IMAGE_USER = "ray"


@pytest.fixture(scope="module")
def docker() -> list[dockerfile.Instruction]:
    return dockerfile.parse(ROOT / "Dockerfile")


def _kernel_check(docker: list[dockerfile.Instruction]) -> dockerfile.Instruction:
    (check,) = [
        i for i in docker if i.keyword == "RUN" and "native.unavailable_reason()" in i.value
    ]
    return check


def test_image_installs_a_c_compiler_as_root(docker: list[dockerfile.Instruction]) -> None:
    (install,) = [i for i in docker if i.keyword == "RUN" and "apt-get install" in i.value]
    packages = install.value.split("apt-get install", 1)[1].split(";")[0].split()
    assert {"gcc", "libc6-dev"} <= set(packages)
    assert "-y" in packages
    assert dockerfile.user_at(docker, install.line, BASE_IMAGE_USER) == "root"
    # Everything after the install (pip, the model, the check, the Pod) runs as `ray` again.
    last = docker[-1].line + 1
    assert dockerfile.user_at(docker, last, BASE_IMAGE_USER) == BASE_IMAGE_USER
    check = _kernel_check(docker)
    assert install.line < check.line
    assert dockerfile.user_at(docker, check.line, BASE_IMAGE_USER) == BASE_IMAGE_USER


def test_kernel_check_runs_after_the_code_and_cache_are_in_place(
    docker: list[dockerfile.Instruction],
) -> None:
    check = _kernel_check(docker)
    (pip_step,) = [i for i in docker if i.keyword == "RUN" and "constraints.txt" in i.value]
    (cache_env,) = [i for i in docker if i.keyword == "ENV" and "PREFIXSERVE_CACHE_DIR" in i.value]
    assert pip_step.line < check.line and cache_env.line < check.line


def _run_check(docker: list[dockerfile.Instruction], **env: str) -> subprocess.CompletedProcess:
    code = dockerfile.shell_form_python(_kernel_check(docker))
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def test_kernel_check_passes_where_kernels_load(docker: list[dockerfile.Instruction]) -> None:
    out = _run_check(docker)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "native kernels: ok"


def test_kernel_check_fails_an_image_without_a_compiler(
    docker: list[dockerfile.Instruction], tmp_path: Path
) -> None:
    env = {"PATH": str(tmp_path), "CC": "", "PREFIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    out = _run_check(docker, **env)
    assert out.returncode != 0
    assert "native kernels unavailable: no_compiler" in out.stderr


def test_kernel_check_fails_when_kernels_are_switched_off(
    docker: list[dockerfile.Instruction],
) -> None:
    out = _run_check(docker, PREFIXSERVE_NATIVE_KERNELS="0")
    assert out.returncode != 0
    assert "native kernels unavailable: disabled" in out.stderr
