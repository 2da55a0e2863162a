"""The oneDNN-packed linear path against ``F.linear``, which rows take it per CPU vendor, and the
decode linear kernels (AMX, AVX512-BF16) against the float32 product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpuinfo import cpu_flags
from engine.kernels import native
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
    onednn = lin._onednn_pack(weight)
    if onednn is None:
        pytest.skip("this torch build has no oneDNN packed linear")
    packed = lin.PackedWeight(onednn, None, 96)
    monkeypatch.setattr(lin, "FP32_PACKED_ROWS", lin.fp32_packed_rows(vendor))
    x = torch.randn(rows, 64)
    got = lin.linear(x, weight, bias, packed)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_without_a_packed_copy_is_f_linear() -> None:
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(lin.linear(x, weight), F.linear(x, weight))


def test_pack_weight_declines_other_dtypes() -> None:
    assert lin.pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None


@pytest.mark.parametrize("rows", [5, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_upcast_linear_rounds_a_float32_product_to_bf16(
    monkeypatch: pytest.MonkeyPatch, rows: int, with_bias: bool
) -> None:
    """Sliced (a small slice size leaves a partial last slice) and whole, the result is the
    float32 product of the bf16 operands rounded once, in a fresh contiguous bf16 tensor, as
    torch's own bf16 kernel computes it: equal but for a rare last-bit difference where the
    float32 sums, added in another order, round the other way."""
    torch.manual_seed(rows)
    weight = (torch.randn(200, 48) * 0.1).bfloat16()
    bias = torch.randn(200).bfloat16() if with_bias else None
    x = torch.randn(rows, 48).bfloat16()
    expected = F.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    ).bfloat16()
    for slice_elems in (48 * 7, 1 << 20):
        monkeypatch.setattr(lin, "UPCAST_SLICE_ELEMS", slice_elems)
        got = lin.upcast_linear(x, weight, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 200) and got.is_contiguous()
        for reference in (expected, F.linear(x, weight, bias)):
            torch.testing.assert_close(got, reference)
            assert (got != reference).float().mean() < 0.01


@pytest.mark.parametrize(
    ("max_rows", "rows", "upcast"),
    [(4, 4, False), (4, 5, True), (4, 512, True), (None, 512, False)],
    ids=["few-rows", "past-the-limit", "prefill", "native-bf16"],
)
def test_bf16_rows_past_the_limit_take_the_float32_path(
    monkeypatch: pytest.MonkeyPatch, max_rows: int | None, rows: int, upcast: bool
) -> None:
    """Only bf16 inputs of more than ``BF16_EMULATED_MAX_ROWS`` rows on a CPU without native
    bf16 are widened; float32 inputs never are."""
    calls: list[int] = []

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        calls.append(x.shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(lin, "BF16_EMULATED_MAX_ROWS", max_rows)
    monkeypatch.setattr(lin, "upcast_linear", spy)
    weight = torch.randn(8, 16)
    lin.linear(torch.randn(rows, 16).bfloat16(), weight.bfloat16())
    lin.linear(torch.randn(rows, 16), weight)
    assert calls == ([rows] if upcast else [])


# Each decode linear kernel this machine runs: AMX where the process may use it, AVX512-BF16
# wherever the CPU has it (Sapphire Rapids too, so both are tested there).
DECODE_KINDS = [
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(
            not native.amx_available(), reason="needs a CPU with AMX (bf16) and the native kernels"
        ),
    ),
    pytest.param(
        "avx512_bf16",
        marks=pytest.mark.skipif(
            not native.avx512_bf16_available(),
            reason="needs a CPU with AVX512-BF16 (avx512_bf16) and the native kernels",
        ),
    ),
]


def test_bf16_weights_get_a_decode_copy_exactly_where_a_decode_kernel_runs() -> None:
    weight = (torch.randn(64, 32) * 0.1).bfloat16()
    packed = lin.pack_weight(weight)
    kind = native.decode_linear_kind()
    if packed is None:
        # Nothing to pack: no decode kernel, and oneDNN has no bf16 kernel on this CPU (AVX2).
        assert kind is None and lin._onednn_pack(weight) is None
        return
    assert packed.out_features == 64 and packed.f32 is None
    assert (packed.decode is not None) == (kind is not None) and packed.kind == kind
    fp32 = lin.pack_weight(torch.randn(64, 32))
    assert fp32 is None or (fp32.decode is None and fp32.kind is None)


def test_the_decode_kind_follows_the_cpu() -> None:
    """AMX first; AVX512-BF16 exactly where /proc/cpuinfo reports it (AMD Zen 4)."""
    kind = native.decode_linear_kind()
    if native.amx_available():
        assert kind == "amx"
    elif native.available() and "avx512_bf16" in cpu_flags():
        assert kind == "avx512_bf16"
        assert lin.decode_max_rows() == lin.DECODE_MAX_ROWS["avx512_bf16"]
    else:
        assert kind is None and lin.decode_max_rows() == 0


@pytest.mark.parametrize("kind", DECODE_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 16, 17, 25, 33, 64, 95, 96, 130])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(96, 64), (200, 48), (64, 1536), (33, 31), (16, 7)]
)
def test_decode_linear_is_the_float32_product_rounded_to_bf16(
    kind: str, rows: int, out_features: int, in_features: int
) -> None:
    """Partial blocks on every side (rows past a register block, outputs past a pair of
    16-blocks, inputs past 32 and an odd number of them) and an input whose rows are a view into
    a wider tensor, with a NaN just past each row's last input (it must not be read)."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    wide = torch.randn(rows, in_features + 8, generator=gen).bfloat16()
    wide[:, 3 + in_features] = float("nan")
    x = wide[:, 3 : 3 + in_features]
    packed = native.decode_pack_weight(weight)
    assert packed is not None
    got = native.decode_linear(x, packed, out_features, kind=kind)
    assert got is not None and got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float()).bfloat16()
    torch.testing.assert_close(got, expected)
    assert (got != expected).float().mean() < 0.01  # the same rounding but for the sum order
    with pytest.raises(ValueError, match="does not match"):
        native.decode_linear(x, packed, out_features + 32, kind=kind)


@pytest.mark.parametrize("kind", DECODE_KINDS)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("rows", [3, 40, 64])
def test_decode_linear_is_the_same_at_every_thread_count(kind: str, gated: bool, rows: int) -> None:
    """Threads claim runs of outputs from both ends (csrc/work_share.h) instead of a fixed
    share: every output must still be computed exactly once, by one thread, in the same order of
    sums, so each thread count gives the one-thread result bit for bit (a skipped output would
    hold whatever the fresh tensor held)."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(2 * 1000, 96, generator=gen) * 0.1).bfloat16()  # 63 pairs: odd
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    packed = native.decode_pack_weight(weight, gated=gated)
    assert packed is not None
    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            results[threads] = native.decode_linear(x, packed, 2 * 1000, gated=gated, kind=kind)
    finally:
        torch.set_num_threads(before)
    one = results[1]
    assert one is not None and one.isfinite().all()
    for threads, got in results.items():
        assert got is not None and torch.equal(got, one), f"{threads} threads"


def spy_decode_linear(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool, str | None]]:
    """Replaces ``native.decode_linear`` with zeros of its output's shape; the list it returns
    fills with each call's (rows, gated, kind)."""
    calls: list[tuple[int, bool, str | None]] = []

    def spy(
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        gated: bool = False,
        kind: str | None = None,
    ) -> torch.Tensor:
        calls.append((x.shape[0], gated, kind))
        return torch.zeros(x.shape[0], out_features // 2 if gated else out_features, dtype=x.dtype)

    monkeypatch.setattr(native, "decode_linear", spy)
    return calls


@pytest.mark.parametrize(
    ("rows", "dtype", "with_bias", "decode"),
    [
        (1, torch.bfloat16, False, True),
        (lin.PACKED_MAX_ROWS["avx512_bf16"], torch.bfloat16, False, True),
        (lin.PACKED_MAX_ROWS["avx512_bf16"] + 1, torch.bfloat16, False, False),
        (4, torch.bfloat16, True, False),
        (4, torch.float32, False, False),
    ],
    ids=["one-row", "at-the-limit", "prefill", "bias", "float32"],
)
@pytest.mark.parametrize("kind", ["amx", "avx512_bf16"])
def test_only_bf16_decode_rows_without_bias_take_the_decode_kernel(
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    rows: int,
    dtype: torch.dtype,
    with_bias: bool,
    decode: bool,
) -> None:
    calls = spy_decode_linear(monkeypatch)
    monkeypatch.setitem(lin.PACKED_MAX_ROWS, kind, lin.PACKED_MAX_ROWS["avx512_bf16"])
    weight = torch.randn(8, 16).to(dtype)
    bias = torch.randn(8).to(dtype) if with_bias else None
    packed = lin.PackedWeight(
        onednn=None, decode=torch.empty(0, dtype=torch.bfloat16), out_features=8, kind=kind
    )
    x = torch.randn(rows, 16).to(dtype)
    got = lin.linear(x, weight, bias, packed)
    assert calls == ([(rows, False, kind)] if decode else [])
    if not decode:
        torch.testing.assert_close(got, F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 128, 129, 2048])
@pytest.mark.parametrize("kind", ["amx", "avx512_bf16"])
def test_gated_rows_past_the_decode_bound_take_the_epilogue_where_it_wins(
    monkeypatch: pytest.MonkeyPatch, kind: str, rows: int
) -> None:
    """An MLP's gate and up take the gated kernel at any row count (its epilogue saves the
    silu_mul pass); the plain product takes the packed tiles up to its kind's bound (AMX's
    prefill kernel at any count, AVX512-BF16 to its decode bound), oneDNN beyond."""
    calls = spy_decode_linear(monkeypatch)
    weight = torch.randn(8, 16).bfloat16()
    decode = torch.empty(0, dtype=torch.bfloat16)
    gated = lin.PackedWeight(onednn=None, decode=decode, out_features=8, gated=True, kind=kind)
    x = torch.randn(rows, 16).bfloat16()
    got = lin.silu_mul_linear(x, weight, None, gated)
    assert got is not None and calls == [(rows, True, kind)]
    calls.clear()
    plain = lin.PackedWeight(onednn=None, decode=decode, out_features=8, kind=kind)
    lin.linear(x, weight, None, plain)
    takes = kind == "amx" or rows <= lin.DECODE_MAX_ROWS["avx512_bf16"]
    assert calls == ([(rows, False, kind)] if takes else [])


@pytest.mark.parametrize("kind", DECODE_KINDS)
@pytest.mark.parametrize("rows", [1, 13, 17, 64, 96])
@pytest.mark.parametrize("inter", [64, 40, 9], ids=["whole-tiles", "partial-tile", "tiny"])
def test_gated_decode_linear_is_silu_mul_of_the_rounded_product(
    monkeypatch: pytest.MonkeyPatch, kind: str, rows: int, inter: int
) -> None:
    """The SiLU epilogue rounds gate and up to bf16 first, then as ``fused.silu_mul``: the same
    values as the two steps but for the sum order."""
    from engine.model import fused

    monkeypatch.setattr(native, "decode_linear_kind", lambda: kind)
    gen = torch.Generator().manual_seed(rows + inter)
    weight = (torch.randn(2 * inter, 96, generator=gen) * 0.2).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    packed = lin.pack_weight(weight, gated=True)
    assert packed is not None and packed.gated and packed.decode is not None
    assert packed.kind == kind
    got = lin.silu_mul_linear(x, weight, None, packed)
    assert got is not None and got.shape == (rows, inter)
    expected = fused.silu_mul(F.linear(x.float(), weight.float()).bfloat16())
    torch.testing.assert_close(got, expected)
    assert (got != expected).float().mean() < 0.02
    # The plain product of a gated copy comes from oneDNN or F.linear, never the gated tiles.
    torch.testing.assert_close(lin.linear(x, weight, None, packed), F.linear(x, weight))
    limit = lin.GATED_MAX_ROWS[kind]
    if limit is None:  # prefill-sized inputs take the epilogue too
        many = torch.randn(lin.DECODE_MAX_ROWS[kind] + 37, 96, generator=gen).bfloat16()
        got = lin.silu_mul_linear(many, weight, None, packed)
        assert got is not None
        torch.testing.assert_close(
            got, fused.silu_mul(F.linear(many.float(), weight.float()).bfloat16())
        )
    else:
        too_many = torch.randn(limit + 1, 96).bfloat16()
        assert lin.silu_mul_linear(too_many, weight, None, packed) is None
    with pytest.raises(ValueError, match="even number of rows"):
        native.decode_pack_weight(weight[1:], gated=True)


AMX_ONLY = pytest.mark.skipif(
    not native.amx_available(), reason="needs a CPU with AMX (bf16) and the native kernels"
)


@AMX_ONLY
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("rows", [97, 128, 129, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(200, 1536), (80, 64), (1000, 96)])
def test_amx_prefill_linear_is_the_float32_product_rounded_to_bf16(
    gated: bool, rows: int, out_features: int, in_features: int
) -> None:
    """Batches past a decode step's rows take the prefill kernel (csrc/amx_prefill_linear.c):
    a last block of fewer than 32 rows, outputs past a pair of 16-blocks (gated: 100, 40 and 500
    outputs), rows in several chunks (700 rows of 1,536 inputs), rows that are a view into a wider
    tensor with a NaN just past each row's last input; and every thread count (grids that split
    the outputs as well as the rows) gives the one-thread result bit for bit."""
    from engine.model import fused

    gen = torch.Generator().manual_seed(rows * out_features + in_features + gated)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    wide = torch.randn(rows, in_features + 8, generator=gen).bfloat16()
    wide[:, 3 + in_features] = float("nan")
    x = wide[:, 3 : 3 + in_features]
    packed = native.decode_pack_weight(weight, gated=gated)
    assert packed is not None
    product = F.linear(x.float(), weight.float()).bfloat16()
    expected = fused.silu_mul(product) if gated else product
    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            results[threads] = native.decode_linear(x, packed, out_features, gated, kind="amx")
    finally:
        torch.set_num_threads(before)
    one = results[1]
    assert one is not None and one.shape == expected.shape
    # A gate summed in another order can round to the neighbouring bf16, which SiLU carries into
    # a small output: an absolute allowance of one bf16 step at 0.5.
    torch.testing.assert_close(one, expected, atol=2**-8, rtol=0.016)
    assert (one != expected).float().mean() < 0.02  # the same rounding but for the sum order
    for threads, got in results.items():
        assert got is not None and torch.equal(got, one), f"{threads} threads"
