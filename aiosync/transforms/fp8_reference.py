"""The reference FP8 quantizer: slow, obviously correct, written from the published formulas.

Every fast quantizer (:mod:`aiosync.transforms.fp8`) must match it bit for bit. Its
conventions (also in ``docs/fp8.md``):

- **Math.** The input (bf16, fp16 or fp32) is widened to fp32, which is exact; every step
  below is fp32 arithmetic rounded to nearest even (IEEE 754), subnormals kept.
- **e4m3** is OCP FP8 E4M3 (torch's ``float8_e4m3fn``): bias 7, no infinities, 448 the
  largest finite value, 2**-9 the least subnormal, ``S.1111.111`` NaN. A value is rounded to
  the nearest e4m3 value, a tie to the one whose code is even; the sign is kept (``-0.0`` is
  ``0x80``); a magnitude above 448 saturates to 448 (OCP's saturating conversion). The block
  and tensor formats never cast a magnitude above 448 * (1 + 2**-23) (their scale is at least
  amax / 448 after rounding) and MX saturates before it casts, so torch's own rule past 448
  (saturating in recent torch, NaN from 464 or 480 in older releases) never matters.
- **Block and tensor scales.** amax is the largest magnitude of the block (a NaN anywhere
  makes it NaN). ``scale = amax / 448`` (fp32 division), raised to :data:`MIN_SCALE` (2**-126,
  the smallest normal fp32) if below it, so a block of tiny values never gets a subnormal or
  zero scale; an all-zero block gets scale 1. Each value is ``x / scale`` (fp32 division) cast
  to e4m3. The scale stored is this dequantization scale (FP8 checkpoints'
  ``weight_scale_inv``: ``x ~ e4m3 * scale``). A block whose amax is infinite gets scale inf:
  its finite values become zero and its infinities NaN; a block holding a NaN gets scale NaN
  and only NaNs.
- **MX scales** (OCP Microscaling v1.0, E4M3 elements, ``emax_elem = 8``): the scale is
  ``2**e`` with ``e = floor(log2(amax)) - 8``, clamped to ``[-127, 127]``, stored as the e8m0
  code ``e + 127`` (uint8). Each value is ``x * 2**-e`` (exact: a power of two), saturated to
  ``[-448, 448]`` and rounded to e4m3. An all-zero block gets code 127 (scale 1); a block
  holding a NaN or an infinity gets code 255 (the e8m0 NaN) and only NaNs.
- **Edges.** A shape that does not divide by the block has partial blocks at its edges;
  each such block's scale comes from its own elements only. Nothing is padded: the output
  has the input's shape and the scales ``ceil(n / block)`` entries along a blocked dim.
- **NaN codes.** A NaN in the output is ``0x7F`` or ``0xFF``: its sign is not defined (fp32
  arithmetic does not define it either, and CPUs and GPUs differ); comparisons of outputs
  treat the two as equal. Here a NaN is always ``0x7F``.
"""

from __future__ import annotations

import functools
import math

import torch

from aiosync.transforms.fp8_formats import (
    BLOCK_SIDE,
    E4M3_EMAX,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_NAN,
    MIN_SCALE,
    MX_BLOCK,
    ZERO_BLOCK_SCALE,
    Fp8Format,
    check_quantizable,
    scale_shape,
)

NAN_CODE = 0x7F
"""The e4m3 code of NaN (with the sign bit clear)."""


@functools.cache
def e4m3_magnitudes() -> torch.Tensor:
    """The 127 finite e4m3 magnitudes (fp64), index = code: the spec's formula, decoded.

    Code ``0EEEEMMM``: ``E == 0`` is subnormal, ``M/8 * 2**-6``; otherwise
    ``(1 + M/8) * 2**(E - 7)``. Code 127 (``E = 15, M = 7``) is NaN and not listed.
    """
    values = []
    for code in range(NAN_CODE):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


def round_to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """The e4m3 codes (``uint8``) nearest to ``values``, ties to the even code, saturating.

    ``values`` are fp32, or fp64 holding values of at most 24 significant bits (the exact
    product of an fp32 value and a power of two). A magnitude above 448 (an infinity too)
    becomes 448 with its sign; a NaN becomes ``0x7F``.
    """
    exact = values.to(torch.float64)  # exact for fp32
    magnitude = exact.abs().clamp(max=E4M3_MAX).contiguous()  # clamp keeps NaN
    table = e4m3_magnitudes()
    upper = torch.searchsorted(table, magnitude.nan_to_num(0.0)).clamp(max=len(table) - 1)
    lower = (upper - 1).clamp(min=0)
    below = magnitude - table[lower]  # exact: multiples of 2**-32 below 2**10, or lower is 0
    above = table[upper] - magnitude
    even = torch.where(lower % 2 == 0, lower, upper)
    code = torch.where(below < above, lower, torch.where(above < below, upper, even))
    code = torch.where(magnitude.isnan(), NAN_CODE, code)
    sign = torch.where(exact.signbit() & (code != NAN_CODE), 0x80, 0)
    return (code | sign).to(torch.uint8)


def e4m3_scale(values: torch.Tensor) -> torch.Tensor:
    """The fp32 dequantization scale of one block or tensor of fp32 ``values`` (0-dim)."""
    if values.isnan().any():
        return torch.tensor(math.nan, dtype=torch.float32)
    amax = values.abs().max()
    if amax == 0:
        return torch.tensor(ZERO_BLOCK_SCALE, dtype=torch.float32)
    scale = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)
    return torch.maximum(scale, torch.tensor(MIN_SCALE, dtype=torch.float32))


def _quantize_scaled(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = e4m3_scale(values)
    return round_to_e4m3(values / scale), scale


def quantize_block_reference(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes (``uint8``, the tensor's shape) and fp32 scales, one per 128 x 128 block."""
    check_quantizable(Fp8Format.BLOCK, _dtype_name(tensor), tuple(tensor.shape))
    values = tensor.detach().cpu().to(torch.float32)
    codes = torch.empty(values.shape, dtype=torch.uint8)
    scales = torch.empty(scale_shape(Fp8Format.BLOCK, tuple(values.shape)), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows = slice(i * BLOCK_SIDE, (i + 1) * BLOCK_SIDE)
            cols = slice(j * BLOCK_SIDE, (j + 1) * BLOCK_SIDE)
            codes[rows, cols], scales[i, j] = _quantize_scaled(values[rows, cols])
    return codes, scales


def quantize_tensor_reference(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes (``uint8``, the tensor's shape) and one fp32 scale (0-dim)."""
    check_quantizable(Fp8Format.TENSOR, _dtype_name(tensor), tuple(tensor.shape))
    return _quantize_scaled(tensor.detach().cpu().to(torch.float32))


def mx_exponent(values: torch.Tensor) -> int | None:
    """The MX scale exponent ``e`` of one block of fp32 ``values``; None if not finite."""
    amax = float(values.abs().max())
    if not math.isfinite(amax):
        return None
    if amax == 0:
        return 0
    floor_log2 = math.frexp(amax)[1] - 1  # frexp: amax = m * 2**k with m in [0.5, 1)
    return max(-E8M0_BIAS, min(E8M0_BIAS, floor_log2 - E4M3_EMAX))


def quantize_mx_reference(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes (``uint8``, the tensor's shape) and e8m0 codes, one per 32 along the last dim."""
    check_quantizable(Fp8Format.MX, _dtype_name(tensor), tuple(tensor.shape))
    values = tensor.detach().cpu().to(torch.float32)
    rows = values.reshape(-1, values.shape[-1])
    codes = torch.empty(rows.shape, dtype=torch.uint8)
    scales = torch.empty(scale_shape(Fp8Format.MX, tuple(rows.shape)), dtype=torch.uint8)
    for i in range(rows.shape[0]):
        for j in range(scales.shape[1]):
            cols = slice(j * MX_BLOCK, (j + 1) * MX_BLOCK)
            block = rows[i, cols]
            exponent = mx_exponent(block)
            if exponent is None:
                codes[i, cols], scales[i, j] = NAN_CODE, E8M0_NAN
                continue
            exact = block.to(torch.float64) * 2.0**-exponent  # a power of two: exact in fp64
            codes[i, cols] = round_to_e4m3(exact)
            scales[i, j] = exponent + E8M0_BIAS
    return codes.reshape(values.shape), scales.reshape(scale_shape(Fp8Format.MX, values.shape))


def quantize_reference(tensor: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantization of ``tensor`` in ``fmt``: (e4m3 codes, scales), on CPU."""
    if fmt is Fp8Format.BLOCK:
        return quantize_block_reference(tensor)
    if fmt is Fp8Format.TENSOR:
        return quantize_tensor_reference(tensor)
    return quantize_mx_reference(tensor)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
