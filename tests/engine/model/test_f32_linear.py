"""The float32 linear kernel (``csrc/f32_linear.c``) against float64 products, its panel layout,
its SiLU epilogue against ``fused.silu_mul``, and where ``linear`` sends float32 inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpuinfo import cpu_flags, cpu_vendor
from engine.kernels import native
from engine.model import fused
from engine.model import linear as lin

needs_kernel = pytest.mark.skipif(
    not native.f32_kernel_available(),
    reason="needs the native kernels built with AVX2 + FMA or AVX-512",
)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), weight.double()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 31, 64, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (50, 37), (96, 576), (7, 5)])
def test_product_matches_float64(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen)
    # Rows with a stride past their length: the kernel reads x through x_stride.
    x = torch.randn(rows, k + 3, generator=gen)[:, :k]
    packed = native.f32_pack_weight(weight)
    assert packed is not None
    got = native.f32_linear(x, packed, n)
    assert got is not None and got.shape == (rows, n)
    torch.testing.assert_close(got, reference(x, weight), rtol=1e-5, atol=1e-5 * k**0.5)


@needs_kernel
def test_a_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Sums run in k order for every row, whatever row block it falls in: a request's logits
    are bit for bit the same alone or in any batch."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 576, generator=gen)
    x = torch.randn(37, 576, generator=gen)
    packed = native.f32_pack_weight(weight)
    assert packed is not None
    batch = native.f32_linear(x, packed, 200)
    assert batch is not None
    for r in (0, 5, 6, 36):
        alone = native.f32_linear(x[r : r + 1], packed, 200)
        assert alone is not None and torch.equal(alone[0], batch[r])


@needs_kernel
def test_panel_layout() -> None:
    """Panel b holds W[16 b + c][k] at element (b * K + k) * 16 + c; features past N are 0."""
    n, k = 20, 3
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k) + 1
    packed = native.f32_pack_weight(weight)
    assert packed is not None and packed.numel() == 2 * k * 16
    panels = packed.view(2, k, 16)
    assert torch.equal(panels[0], weight[:16].t())
    assert torch.equal(panels[1, :, :4], weight[16:].t())
    assert not panels[1, :, 4:].any()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 13, 64])
@pytest.mark.parametrize("inter", [64, 40, 9], ids=["whole-panels", "partial-panel", "tiny"])
def test_gated_product_is_silu_mul_of_the_product(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    weight = torch.randn(2 * inter, 96, generator=gen) * 0.2
    x = torch.randn(rows, 96, generator=gen)
    packed = native.f32_pack_weight(weight, gated=True)
    assert packed is not None
    got = native.f32_linear(x, packed, 2 * inter, gated=True)
    assert got is not None and got.shape == (rows, inter)
    expected = fused.silu_mul(reference(x, weight))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even number of rows"):
        native.f32_pack_weight(weight[1:], gated=True)


@needs_kernel
def test_a_copy_of_another_shape_is_refused() -> None:
    packed = native.f32_pack_weight(torch.randn(32, 16))
    assert packed is not None
    with pytest.raises(ValueError, match="does not match"):
        native.f32_linear(torch.randn(2, 16), packed, 48)
    assert native.f32_linear(torch.randn(2, 16).bfloat16(), packed, 32) is None


@pytest.mark.parametrize(
    ("flags", "vendor", "wins"),
    [
        ({"avx2", "fma"}, "AuthenticAMD", True),  # Zen 2/3
        ({"avx2", "fma"}, "GenuineIntel", True),  # laptops
        ({"avx2", "avx512f", "avx512_bf16"}, "AuthenticAMD", True),  # Zen 4
        ({"avx2", "avx512f", "amx_bf16"}, "GenuineIntel", False),  # Sapphire Rapids: oneDNN
    ],
)
def test_where_the_kernel_wins(flags: set[str], vendor: str, wins: bool) -> None:
    assert native.f32_kernel_wins(frozenset(flags), vendor) is wins


def test_the_kernel_is_preferred_where_built_and_it_wins() -> None:
    flags = cpu_flags()
    expected = native.f32_kernel_available() and native.f32_kernel_wins(flags, cpu_vendor())
    assert native.f32_linear_preferred() == expected
    packed = lin.pack_weight(torch.randn(64, 32))
    if expected:
        # The panels replace oneDNN's copy: one extra copy of the weights, not two.
        assert packed is not None and packed.f32 is not None and packed.onednn is None
    else:
        assert packed is None or packed.f32 is None
    bf16 = lin.pack_weight(torch.randn(64, 32).bfloat16())
    assert bf16 is None or bf16.f32 is None


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_sends_unbiased_float32_inputs_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch, with_bias: bool
) -> None:
    calls: list[tuple[int, bool]] = []

    def fake(x: torch.Tensor, packed: torch.Tensor, n: int, gated: bool = False) -> torch.Tensor:
        calls.append((x.shape[0], gated))
        return torch.zeros(x.shape[0], n // 2 if gated else n)

    monkeypatch.setattr(native, "f32_linear", fake)
    weight = torch.randn(8, 16)
    bias = torch.randn(8) if with_bias else None
    packed = lin.PackedWeight(None, None, 8, f32=torch.empty(0))
    x = torch.randn(300, 16)
    got = lin.linear(x, weight, bias, packed)
    if with_bias:
        assert calls == [] and torch.equal(got, F.linear(x, weight, bias))
    else:
        assert calls == [(300, False)] and not got.any()
    gated = lin.PackedWeight(None, None, 8, gated=True, f32=torch.empty(0))
    act = lin.silu_mul_linear(x, weight, bias, gated)
    assert (act is None) == with_bias
    assert lin.silu_mul_linear(x.bfloat16(), weight.bfloat16(), None, gated) is None
