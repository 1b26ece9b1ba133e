"""The fast FP8 quantizer equals the reference bit for bit, and writes only its destination."""

from __future__ import annotations

import itertools

import pytest
import torch

from aiosync.core.errors import MismatchError
from aiosync.transforms.fp8 import quantize, quantize_into
from aiosync.transforms.fp8_formats import Fp8Format, scale_shape
from aiosync.transforms.fp8_reference import quantize_reference
from tests.helpers.fp8_data import (
    SHAPES,
    SOURCE_DTYPES,
    assert_same_codes,
    assert_same_scales,
    random_weights,
    with_special_values,
)

CASES = [
    (fmt, shape, dtype)
    for fmt, shapes in SHAPES.items()
    for shape, dtype in itertools.product(shapes, SOURCE_DTYPES)
]


def _case_id(case: tuple[Fp8Format, tuple[int, ...], torch.dtype]) -> str:
    fmt, shape, dtype = case
    return f"{fmt.value}-{'x'.join(map(str, shape))}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fast_equals_reference(case: tuple[Fp8Format, tuple[int, ...], torch.dtype]) -> None:
    fmt, shape, dtype = case
    x = random_weights(shape, dtype, seed=len(CASES) + sum(shape))
    got, scales = quantize(x, fmt, kernel="torch")
    want, want_scales = quantize_reference(x, fmt)
    assert got.dtype == torch.float8_e4m3fn
    assert got.shape == x.shape
    assert_same_codes(got, want)
    assert_same_scales(scales, want_scales)


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=str)
def test_fast_equals_reference_with_nan_inf_zeros_and_subnormals(
    fmt: Fp8Format, dtype: torch.dtype
) -> None:
    shape = (300, 260) if fmt is not Fp8Format.TENSOR else (1000,)
    x = with_special_values(random_weights(shape, dtype, seed=3))
    got, scales = quantize(x, fmt, kernel="torch")
    want, want_scales = quantize_reference(x, fmt)
    assert_same_codes(got, want)
    assert_same_scales(scales, want_scales)
    assert scales.isnan().any() if fmt is not Fp8Format.MX else (scales == 0xFF).any()


@pytest.mark.parametrize("fmt", [Fp8Format.BLOCK, Fp8Format.TENSOR, Fp8Format.MX])
def test_tiny_and_zero_blocks_match(fmt: Fp8Format) -> None:
    x = torch.zeros(256, 160)
    x[:128, :128] = torch.randn(128, 128) * 1e-38  # subnormal fp32 values: scale 2**-126
    x[128:, 128:] = 2.0**-149
    got, scales = quantize(x, fmt)
    want, want_scales = quantize_reference(x, fmt)
    assert_same_codes(got, want)
    assert_same_scales(scales, want_scales)
    assert got.view(torch.uint8)[:128, :128].any()  # the subnormals did not flush to zero


def test_a_strided_source_equals_the_reference() -> None:
    x = random_weights((300, 140), torch.bfloat16, seed=5).t()  # not contiguous
    for fmt in Fp8Format:
        got, scales = quantize(x, fmt)
        want, want_scales = quantize_reference(x, fmt)
        assert_same_codes(got, want)
        assert_same_scales(scales, want_scales)


def test_a_parameter_that_requires_grad_is_quantized() -> None:
    weight = torch.nn.Parameter(random_weights((200, 130), torch.bfloat16, seed=8))
    for fmt in Fp8Format:
        got, scales = quantize(weight, fmt)
        want, want_scales = quantize_reference(weight.detach(), fmt)
        assert_same_codes(got, want)
        assert_same_scales(scales, want_scales)
        assert not got.requires_grad


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_writes_straight_into_packing_buffer_views_and_nowhere_else(fmt: Fp8Format) -> None:
    x = random_weights((130, 70), torch.float16, seed=6)
    scale_numel = max(1, torch.Size(scale_shape(fmt, tuple(x.shape))).numel())
    scale_bytes = scale_numel * (1 if fmt is Fp8Format.MX else 4)
    buffer = torch.full((16384,), 0xAB, dtype=torch.uint8)
    values_at, scales_at = 512, 512 + 130 * 70 + 4  # the scales 4-byte aligned, not 512
    quantize_into(
        x,
        fmt,
        buffer[values_at : values_at + x.numel()],
        buffer[scales_at : scales_at + scale_bytes],
    )
    want, want_scales = quantize_reference(x, fmt)
    assert_same_codes(buffer[values_at : values_at + x.numel()].view(x.shape), want)
    got_scales = buffer[scales_at : scales_at + scale_bytes].view(want_scales.dtype)
    assert_same_scales(got_scales.view(want_scales.shape), want_scales)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[values_at : values_at + x.numel()] = False
    untouched[scales_at : scales_at + scale_bytes] = False
    assert (buffer[untouched] == 0xAB).all()


def test_typed_destinations_of_the_tensors_shape_are_taken() -> None:
    x = random_weights((256, 256), torch.bfloat16, seed=7)
    out = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.empty(2, 2)
    quantize_into(x, Fp8Format.BLOCK, out, scales)
    want, want_scales = quantize_reference(x, Fp8Format.BLOCK)
    assert_same_codes(out, want)
    assert_same_scales(scales, want_scales)


def test_destinations_that_do_not_fit_are_refused_naming_the_tensor() -> None:
    x = torch.ones(256, 256)
    with pytest.raises(MismatchError, match=r"cannot hold.*'w'"):
        quantize_into(
            x, Fp8Format.BLOCK, torch.empty(100, dtype=torch.uint8), torch.empty(4), name="w"
        )
    with pytest.raises(MismatchError, match="cannot hold"):  # an MX scale is one byte
        quantize_into(x, Fp8Format.MX, torch.empty(65536, dtype=torch.uint8), torch.empty(2048))
    strided = torch.empty(256, 512, dtype=torch.uint8)[:, ::2]
    with pytest.raises(MismatchError, match="cannot hold"):  # not contiguous
        quantize_into(x, Fp8Format.BLOCK, strided, torch.empty(4))
    with pytest.raises(MismatchError, match="4-byte aligned"):
        quantize_into(
            x,
            Fp8Format.BLOCK,
            torch.empty(65536, dtype=torch.uint8),
            torch.empty(20, dtype=torch.uint8)[2:18],
        )
    with pytest.raises(MismatchError, match="Triton"):
        quantize(x, Fp8Format.BLOCK, kernel="triton")
    with pytest.raises(MismatchError, match="Triton"):
        quantize(x, Fp8Format.MX, kernel="triton")
    with pytest.raises(MismatchError, match="2-D"):
        quantize(torch.ones(2, 2, 2), Fp8Format.BLOCK)
