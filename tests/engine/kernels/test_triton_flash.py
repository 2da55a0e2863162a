"""The Triton FlashAttention kernels (``engine.kernels.triton_flash``) and the flash backend on
them, against plain PyTorch attention: varlen over paged and contiguous K/V, decode through
``flash_attn_with_kvcache`` with one split and several, and the backend against the torch
backend on the same step (see ``tests.engine.kernels.flash_cases``).

On CPU the checks run under Triton's interpreter in fp32 and fp16, in a child process (the
interpreter is chosen by ``TRITON_INTERPRET=1`` before triton is imported, and this process may
already have imported it); with a GPU they also run compiled, in-process, in fp16 and bf16.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if platform.system() == "Linux" and platform.machine() == "x86_64":
    # The dev extra installs triton here (CI's platform): without it the module fails.
    import triton  # noqa: F401
else:
    # Elsewhere the dev extra does not install triton (macOS has no wheels): nothing to run.
    pytest.importorskip("triton", reason="the dev extra installs triton on Linux x86-64 only")

from engine.kernels.triton_flash import num_splits_for  # noqa: E402
from tests.engine.kernels.flash_cases import CASES, INTERPRETER_DTYPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.kernels.flash_cases"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreter_matches_reference(case, interpreter_results):
    for dtype in INTERPRETER_DTYPES:
        failure = interpreter_results[f"{case}/{dtype}"]
        assert failure is None, f"{case} in {dtype}:\n{failure}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_matches_reference(case, dtype):
    CASES[case]("cuda", dtype)


def test_split_count_depends_on_shapes_only():
    # Few sequences and long block tables: as many splits as fill the GPU, capped.
    assert num_splits_for(1, 8, 512, 16) == 32
    assert num_splits_for(4, 8, 512, 16) == 8
    # Short block tables: no split shorter than 256 keys.
    assert num_splits_for(1, 8, 16, 16) == 1
    assert num_splits_for(1, 8, 40, 16) == 3
    # A large batch fills the GPU without splitting.
    assert num_splits_for(64, 8, 512, 16) == 1
