"""The GPU extras resolve, from PyPI, to a CUDA torch that the resolved transformers accepts and
the FlashAttention kernels each extra is for (tests/packaging/gpu_resolve.py does the resolving).

The resolution tests need PyPI (CI has it) and skip, saying so, where it cannot be reached; the
checks of the checker itself run anywhere.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.packaging import gpu_resolve
from tests.packaging.gpu_resolve import Resolved, problems, requirements

ROOT = Path(__file__).resolve().parents[2]
# torch 2.4.0 with vllm-flash-attn, but transformers left to the base range: what the `gpu`
# extra used to install. The newest transformers then disables torch at import.
UNCAPPED_TORCH_24 = [
    *requirements([]),
    "torch==2.4.0",
    "vllm-flash-attn==2.6.2",
]


@pytest.fixture(scope="module")
def resolutions() -> dict[str, dict[str, Resolved]]:
    reason = gpu_resolve.pypi_unreachable()
    if reason:
        pytest.skip(f"{reason}: the GPU extras' resolution needs PyPI (`make gpu-resolve`)")
    sets = {extra: requirements([extra]) for extra in gpu_resolve.GPU_EXTRAS}
    sets["uncapped"] = UNCAPPED_TORCH_24
    return gpu_resolve.resolve_all(sets)


def _pinned(package: Resolved, name: str) -> SpecifierSet:
    """``package``'s own requirement on ``name`` (on Linux x86-64)."""
    (req,) = [
        r
        for r in map(Requirement, package.requires_dist)
        if r.name == name and (r.marker is None or r.marker.evaluate({"extra": ""}))
    ]
    return req.specifier


def test_gpu_extra_is_current_cuda_torch_with_triton(
    resolutions: dict[str, dict[str, Resolved]],
) -> None:
    gpu = resolutions["gpu"]
    assert problems(gpu) == []
    torch, triton = gpu["torch"], gpu["triton"]
    assert torch.version >= Version("2.6"), torch
    assert gpu_resolve.is_cuda_build(torch, gpu)
    assert "vllm-flash-attn" not in gpu
    # The triton that torch's wheel pins, at or above the Triton kernels' floor.
    assert triton.version >= Version("3.2"), triton
    assert triton.version in _pinned(torch, "triton")


def test_vllm_flash_attn_extra_is_torch_24_with_a_transformers_that_enables_it(
    resolutions: dict[str, dict[str, Resolved]],
) -> None:
    resolved = resolutions["gpu-vllm-flash-attn"]
    assert problems(resolved) == []
    torch, flash = resolved["torch"], resolved["vllm-flash-attn"]
    assert torch.version == Version("2.4.0")
    assert gpu_resolve.is_cuda_build(torch, resolved)
    assert flash.version == Version("2.6.2")
    assert torch.version in _pinned(flash, "torch")
    # The newest transformers whose own torch floor is at most 2.4.
    assert resolved["transformers"].version >= Version("5.14"), resolved["transformers"]
    # `dev` goes with it: the triton that torch 2.4 pins is within dev's triton range.
    (dev_triton,) = [r for r in map(Requirement, requirements(["dev"])) if r.name == "triton"]
    assert resolved["triton"].version in dev_triton.specifier


def test_the_check_catches_transformers_disabling_torch_24(
    resolutions: dict[str, dict[str, Resolved]],
) -> None:
    # pip resolves it (transformers names torch only in an extra), yet it cannot run.
    uncapped = resolutions["uncapped"]
    assert uncapped["torch"].version == Version("2.4.0")
    (problem,) = problems(uncapped)
    assert f"disables torch {uncapped['torch'].version}" in problem


# -- the checker and its inputs, without an index ---------------------------------------------


def _resolved(name: str, version: str, *requires: str, url: str = "") -> Resolved:
    return Resolved(name, Version(version), url or f"https://x/{name}-{version}.whl", requires)


def _fake_set(torch_version: str, transformers_floor: str, cuda: bool) -> dict[str, Any]:
    torch_requires = ["nvidia-cuda-runtime-cu12==12.4.127; platform_system == 'Linux'"]
    out = {
        "torch": _resolved("torch", torch_version, *(torch_requires if cuda else [])),
        "transformers": _resolved(
            "transformers",
            "5.24.0",
            "tokenizers<0.24,>=0.23.1",
            f'torch>={transformers_floor}; extra == "torch"',
            'torch>=2.0; extra == "all"',
        ),
    }
    if cuda:
        out["nvidia-cuda-runtime-cu12"] = _resolved("nvidia-cuda-runtime-cu12", "12.4.127")
    return out


def test_problems_name_a_cpu_torch_and_a_transformers_floor_above_it() -> None:
    assert problems(_fake_set("2.6.0", "2.6", cuda=True)) == []
    (cpu,) = problems(_fake_set("2.13.0+cpu", "2.6", cuda=False))
    assert "torch 2.13.0+cpu is not a CUDA build" in cpu
    (floor,) = problems(_fake_set("2.4.0", "2.6", cuda=True))
    assert floor == "transformers 5.24.0 needs torch>=2.6 and disables torch 2.4.0 at import"
    assert problems({}) == ["torch was not resolved"]


def test_requirements_are_the_base_plus_the_extra() -> None:
    base = requirements([])
    assert "torch>=2.4" in base and not any(r.startswith("triton") for r in base)
    gpu = requirements(["gpu"])
    assert gpu[: len(base)] == base
    assert {Requirement(r).name for r in gpu[len(base) :]} == {"torch", "triton"}
    with pytest.raises(KeyError, match="no extra 'cuda'"):
        requirements(["cuda"])


def test_pip_sees_pypi_only() -> None:
    env = gpu_resolve.pip_env(
        {
            "PATH": "/usr/bin",
            "PIP_FIND_LINKS": "/opt/wheels",
            "PIP_INDEX_URL": "https://download.pytorch.org/whl/cpu",
            "PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple",
            "PIP_CONSTRAINT": "/etc/constraints.txt",
            "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",
        }
    )
    assert env["PATH"] == "/usr/bin" and env["PIP_CERT"].endswith(".crt")
    assert not {"PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"} & set(
        env
    )
    command = gpu_resolve.pip_command(["torch>=2.6"], Path("/tmp/r.json"))
    assert command[command.index("--index-url") + 1] == gpu_resolve.PYPI
    platforms = {command[i + 1] for i, arg in enumerate(command) if arg == "--platform"}
    # The image's glibc and every older tag a wheel may carry alone (torch 2.4: manylinux1).
    assert {"manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64"} <= platforms


def test_make_gpu_resolve_runs_the_resolver(tmp_path: Path) -> None:
    out = subprocess.run(
        ["make", "-n", "gpu-resolve", f"VENV={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    (command,) = [line for line in out.stdout.splitlines() if "-m tests.packaging" in line]
    assert command == f"{tmp_path}/bin/python -m tests.packaging.gpu_resolve"
