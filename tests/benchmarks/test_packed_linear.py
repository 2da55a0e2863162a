"""benchmarks.packed_linear times two computations of the same linear: they must agree."""

from __future__ import annotations

import pytest
import torch

from benchmarks.packed_linear import SHAPES, pair
from engine.kernels import native


@pytest.mark.skipif(
    native.decode_linear_kind() is None,
    reason="needs a decode linear kernel (AMX or AVX512-BF16) and the native kernels",
)
@pytest.mark.parametrize("name", list(SHAPES))
def test_both_sides_compute_the_same_linear(name: str) -> None:
    k, n, gated = SHAPES[name]
    onednn, tiles = pair(100, k, n, gated)
    a, b = onednn(), tiles()
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    assert a.shape == b.shape == (100, n // 2 if gated else n)
    torch.testing.assert_close(b, a, atol=2**-8, rtol=0.016)
