"""The oneDNN-packed linear path against ``F.linear``, and which rows take it per CPU vendor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import linear as lin


@pytest.mark.parametrize(
    ("vendor", "packed", "unpacked"),
    [
        ("GenuineIntel", [4, 64, 256], [1, 2, 3, 257, 2048]),
        ("", [4, 256], [1, 512]),
        ("AuthenticAMD", [1, 2, 3, 4, 256, 257, 2048, 8192], []),
    ],
)
def test_fp32_packed_rows_per_vendor(vendor: str, packed: list[int], unpacked: list[int]) -> None:
    rows = lin.fp32_packed_rows(vendor)
    assert all(n in rows for n in packed)
    assert not any(n in rows for n in unpacked)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("rows", [1, 2, 5, 300])
def test_linear_matches_f_linear_on_either_path(
    monkeypatch: pytest.MonkeyPatch, vendor: str, rows: int
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * 0.1
    bias = torch.randn(96)
    packed = lin.pack_weight(weight)
    if packed is None:
        pytest.skip("this torch build has no oneDNN packed linear")
    monkeypatch.setattr(lin, "FP32_PACKED_ROWS", lin.fp32_packed_rows(vendor))
    x = torch.randn(rows, 64)
    got = lin.linear(x, weight, bias, packed)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_without_a_packed_copy_is_f_linear() -> None:
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(lin.linear(x, weight), F.linear(x, weight))


def test_pack_weight_declines_other_dtypes() -> None:
    assert lin.pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None
