"""FP8 quantize on CUDA: bit for bit the CPU reference, and Llama-3-8B against its floor.

Each case runs on both kernels (torch ops, and the Triton block kernel where it runs). The
timing test prints ``benchmarks.fp8_quantize``'s JSON (issue 28: the 128 x 128 quantize of
Llama-3-8B in bf16 within 2x of its bandwidth floor); it asserts no time.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from aiosync.transforms.fp8 import Kernel, quantize
from aiosync.transforms.fp8_formats import Fp8Format
from aiosync.transforms.fp8_reference import quantize_reference
from aiosync.transforms.fp8_triton import triton_can_run
from tests.conftest import requires_cuda
from tests.helpers.fp8_data import (
    SHAPES,
    SOURCE_DTYPES,
    assert_same_codes,
    assert_same_scales,
    random_weights,
    with_special_values,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

LARGE_SHAPES = [(1024, 4096), (1000, 4100)]
"""Real widths: whole blocks, and partial edge blocks on both dims."""


def _kernels(fmt: Fp8Format) -> list[Kernel]:
    return ["torch", "triton"] if fmt is Fp8Format.BLOCK else ["torch"]


def _check(x: torch.Tensor, fmt: Fp8Format, kernel: Kernel) -> None:
    if kernel == "triton" and not triton_can_run(x):
        pytest.skip("triton is not installed or this GPU has no e4m3 conversions")
    got, scales = quantize(x, fmt, kernel=kernel)
    assert got.is_cuda
    assert scales.is_cuda
    want, want_scales = quantize_reference(x.cpu(), fmt)
    assert_same_codes(got, want)
    assert_same_scales(scales, want_scales)


CASES = [
    (fmt, shape, dtype, kernel)
    for fmt, shapes in SHAPES.items()
    for shape, dtype, kernel in itertools.product(shapes, SOURCE_DTYPES, _kernels(fmt))
]


@pytest.mark.parametrize(("fmt", "shape", "dtype", "kernel"), CASES)
def test_cuda_equals_the_cpu_reference(
    fmt: Fp8Format, shape: tuple[int, ...], dtype: torch.dtype, kernel: Kernel
) -> None:
    _check(random_weights(shape, dtype, seed=sum(shape), device="cuda"), fmt, kernel)


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_cuda_equals_the_reference_on_real_widths_and_special_values(
    fmt: Fp8Format, dtype: torch.dtype, kernel: Kernel
) -> None:
    if kernel not in _kernels(fmt):
        pytest.skip("the Triton kernel is for blocks")
    for shape in LARGE_SHAPES:
        _check(random_weights(shape, dtype, seed=1, device="cuda"), fmt, kernel)
    special = with_special_values(random_weights((300, 260), dtype, seed=2))
    _check(special.cuda(), fmt, kernel)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_cuda_tiny_blocks_keep_their_subnormals(kernel: Kernel) -> None:
    x = torch.zeros(256, 160)
    x[:128, :128] = torch.randn(128, 128, generator=torch.Generator().manual_seed(4)) * 1e-38
    x[128:, 128:] = 2.0**-149
    _check(x.cuda(), Fp8Format.BLOCK, kernel)


def test_cuda_strided_source() -> None:
    x = random_weights((300, 140), torch.bfloat16, seed=5, device="cuda").t()
    for fmt in Fp8Format:
        for kernel in _kernels(fmt):
            _check(x, fmt, kernel)


def test_llama_3_8b_block_quantize_against_its_bandwidth_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.fp8_quantize import measure

    out = measure(Fp8Format.BLOCK, repeats=5)
    with capsys.disabled():
        print("\nfp8 quantize, Llama-3-8B bf16:", json.dumps(out))
    assert out["tensors"] == 291
    assert out["bytes_read"] == 16_060_522_496
    assert out["fast_bit_exact"]
    assert min(out["floor_ms"], out["fast_ms"], out["torch_ms"], out["naive_ms"]) > 0
