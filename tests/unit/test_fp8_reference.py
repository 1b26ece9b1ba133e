"""The reference FP8 quantizer: hand-worked values, and its rounding against torch's cast."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiosync.core.errors import MismatchError
from aiosync.transforms.fp8_formats import Fp8Format
from aiosync.transforms.fp8_reference import (
    e4m3_magnitudes,
    mx_exponent,
    quantize_block_reference,
    quantize_mx_reference,
    quantize_reference,
    quantize_tensor_reference,
    round_to_e4m3,
)

NAN = float("nan")
INF = float("inf")


def fp32(value: float | Fraction) -> torch.Tensor:
    """The fp32 nearest ``value`` (through fp64: innocuous for one division's result)."""
    return torch.tensor(float(value), dtype=torch.float64).to(torch.float32)


def codes(*values: float) -> torch.Tensor:
    return round_to_e4m3(torch.tensor(values, dtype=torch.float32))


def test_the_decoded_table_is_what_torch_decodes() -> None:
    every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = every_code.view(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(decoded[:127], e4m3_magnitudes())
    assert torch.equal(decoded[128:255], -e4m3_magnitudes())
    assert decoded[127].isnan()
    assert decoded[255].isnan()
    assert e4m3_magnitudes()[-1] == 448
    assert e4m3_magnitudes()[1] == 2.0**-9


def test_hand_rounded_values() -> None:
    assert codes(1.0, 0.5, 448.0, -448.0).tolist() == [0x38, 0x30, 0x7E, 0xFE]
    assert codes(2.0**-6, 2.0**-9, 7 * 2.0**-9).tolist() == [0x08, 0x01, 0x07]  # normal, subnormal
    assert codes(0.0, -0.0, -(2.0**-11)).tolist() == [0x00, 0x80, 0x80]  # the sign is kept


def test_ties_round_to_the_even_code() -> None:
    assert codes(1.0625, 1.1875).tolist() == [0x38, 0x3A]  # halfway 1|1.125 and 1.125|1.25
    assert codes(2.0**-10, 3 * 2.0**-10).tolist() == [0x00, 0x02]  # subnormal halfway points
    assert codes(416.0 + 16.0, -(416.0 + 16.0)).tolist() == [0x7E, 0xFE]  # 432: 416|448 -> 448
    just_above = torch.nextafter(torch.tensor(1.0625), torch.tensor(2.0))
    assert round_to_e4m3(just_above.reshape(1)).tolist() == [0x39]


def test_out_of_range_saturates_and_nan_is_0x7f() -> None:
    assert codes(449.0, 464.0, 1e30, INF, -INF).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert codes(NAN, -NAN).tolist() == [0x7F, 0x7F]


def _agrees_with_torch(values: torch.Tensor) -> None:
    """Where every torch release agrees (below 464, and NaN), the rounding is torch's cast."""
    values = values[~(values.abs() >= 464)]
    mine = round_to_e4m3(values)
    theirs = values.to(torch.float8_e4m3fn).view(torch.uint8)
    nan = values.isnan()
    assert torch.equal(mine[~nan], theirs[~nan])
    assert ((theirs[nan] & 0x7F) == 0x7F).all()
    assert (mine[nan] == 0x7F).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_precision_value_rounds_as_torch_casts(dtype: torch.dtype) -> None:
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    _agrees_with_torch(every.to(torch.float32))


def test_midpoints_and_their_neighbours_round_as_torch_casts() -> None:
    table = e4m3_magnitudes().to(torch.float32)
    midpoints = (table[1:] + table[:-1]) / 2  # exact in fp32
    around = torch.cat([midpoints, table])
    up = torch.nextafter(around, torch.tensor(INF))
    down = torch.nextafter(around, torch.tensor(0.0))
    values = torch.cat([around, up, down])
    _agrees_with_torch(torch.cat([values, -values]))


@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_any_fp32_rounds_as_torch_casts(value: float) -> None:
    _agrees_with_torch(torch.tensor([value], dtype=torch.float32))


def test_a_block_with_amax_448_has_scale_1_and_keeps_representable_values() -> None:
    block = torch.zeros(128, 128)
    block[0, :4] = torch.tensor([448.0, -448.0, 1.0, 0.5])
    got, scales = quantize_block_reference(block)
    assert scales.tolist() == [[1.0]]
    assert got[0, :5].tolist() == [0x7E, 0xFE, 0x38, 0x30, 0x00]


def test_scale_is_amax_over_448_rounded_in_fp32() -> None:
    block = torch.full((3, 5), 0.25)
    block[1, 2] = -1.0
    _, scale = quantize_tensor_reference(block)
    assert scale.view(torch.int32) == fp32(Fraction(1, 448)).view(torch.int32)
    got, _ = quantize_tensor_reference(block)
    # -1 / scale is -447.99997 (the scale rounded up): it rounds to -448
    assert got[1, 2] == 0xFE
    assert got[0, 0] == round_to_e4m3(block[0, 0] / scale)


def test_an_all_zero_block_gets_scale_1_and_zero_codes() -> None:
    block = torch.zeros(130, 129)
    block[:128, :128] = 3.0
    block[128, 128] = -0.0
    got, scales = quantize_block_reference(block)
    assert scales.tolist() == [[fp32(3 / 448).item(), 1.0], [1.0, 1.0]]
    assert got[128:, 128:].tolist() == [[0x80], [0x00]]


def test_a_partial_edge_block_uses_its_own_amax() -> None:
    block = torch.full((130, 200), 100.0)
    block[128:, 128:] = 2.0
    _, scales = quantize_block_reference(block)
    assert scales.shape == (2, 2)
    assert scales[1, 1] == fp32(2.0) / 448
    assert scales[0, 1] == fp32(100.0) / 448


def test_tiny_blocks_get_the_least_normal_scale() -> None:
    tiny = torch.tensor([2.0**-130, -(2.0**-140), 0.0])  # amax below 448 * 2**-126
    got, scale = quantize_tensor_reference(tiny)
    assert scale == 2.0**-126
    assert got.tolist() == [0x18, 0x80, 0x00]  # 2**-4, -2**-14 (rounds to -0), 0


def test_non_finite_blocks() -> None:
    got, scale = quantize_tensor_reference(torch.tensor([1.0, INF, -2.0]))
    assert scale == INF
    assert got.tolist() == [0x00, 0x7F, 0x80]
    got, scale = quantize_tensor_reference(torch.tensor([1.0, NAN, INF]))
    assert scale.isnan()
    assert got.tolist() == [0x7F, 0x7F, 0x7F]


@pytest.mark.parametrize(
    ("amax", "exponent"),
    [
        (1.0, -8),
        (448.0, 0),
        (511.0, 0),
        (512.0, 1),
        (0.75, -9),
        (2.0**-119, -127),
        (2.0**-130, -127),  # clamped to e8m0's least
        (2.0**-149, -127),
        (float(torch.finfo(torch.float32).max), 119),
        (0.0, 0),
    ],
)
def test_e8m0_exponent_is_floor_log2_amax_minus_8_clamped(amax: float, exponent: int) -> None:
    assert mx_exponent(torch.tensor([amax, -amax / 3])) == exponent


def test_mx_values_and_codes() -> None:
    row = torch.zeros(33)
    row[:4] = torch.tensor([500.0, 1.0, -(2.0**-9), 3.0])  # amax 500: e = 0, scale 1
    row[32] = 0.75  # its own block: e = -9
    got, scales = quantize_mx_reference(row)
    assert scales.tolist() == [127, 118]
    assert got[:4].tolist() == [0x7E, 0x38, 0x81, 0x44]  # 500 saturates to 448
    assert got[32] == 0x7C  # 0.75 * 2**9 = 384 = 1.5 * 2**8


def test_mx_zero_and_non_finite_blocks() -> None:
    rows = torch.zeros(3, 32)
    rows[1, 5] = NAN
    rows[2, 0] = -INF
    got, scales = quantize_mx_reference(rows)
    assert scales.tolist() == [[127], [255], [255]]
    assert (got[0] == 0).all()
    assert (got[1:] == 0x7F).all()


def test_mx_keeps_leading_dims() -> None:
    got, scales = quantize_mx_reference(torch.ones(2, 3, 70))
    assert got.shape == (2, 3, 70)
    assert scales.shape == (2, 3, 3)
    assert (scales == 119).all()
    assert (got == 0x38 + (8 << 3)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inputs_are_widened_exactly(dtype: torch.dtype) -> None:
    x = (torch.randn(40, 50, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    for fmt in Fp8Format:
        got, scales = quantize_reference(x, fmt)
        want, want_scales = quantize_reference(x.to(torch.float32), fmt)
        assert torch.equal(got, want)
        assert torch.equal(scales, want_scales)


def test_what_a_format_cannot_take_is_refused() -> None:
    with pytest.raises(MismatchError, match="2-D"):
        quantize_block_reference(torch.ones(5))
    with pytest.raises(MismatchError, match="float64"):
        quantize_tensor_reference(torch.ones(5, dtype=torch.float64))
    with pytest.raises(MismatchError, match="empty"):
        quantize_mx_reference(torch.ones(0, 4))
    with pytest.raises(MismatchError, match="one dim"):
        quantize_tensor_reference(torch.tensor(1.0))
