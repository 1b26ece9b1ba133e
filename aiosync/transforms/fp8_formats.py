"""The FP8 formats a quantizing transform writes, and the facts its quantizers share.

Pure: formats, constants, the scales' shapes and dtypes; no data is touched, so a layout
can be planned from a manifest alone. The conventions are stated in ``docs/fp8.md`` and in
:mod:`aiosync.transforms.fp8_reference`.
"""

from __future__ import annotations

import enum
import math

from aiosync.core.errors import MismatchError


class Fp8Format(enum.Enum):
    """Which e4m3 quantization a tensor gets; each value's name is its wire name."""

    BLOCK = "block"
    """One fp32 scale per 128 x 128 block of a 2-D tensor (checkpoints' ``weight_scale_inv``)."""
    TENSOR = "tensor"
    """One fp32 scale for the whole tensor (any shape)."""
    MX = "mx"
    """MXFP8: one e8m0 scale (a ``uint8`` biased exponent) per 32 elements along the last dim."""


E4M3_MAX = 448.0
"""The largest finite e4m3 magnitude; a block's scale is its amax / ``E4M3_MAX``."""
E4M3_EMAX = 8
"""The exponent of the largest power of two e4m3 holds (256): MX's ``emax_elem``."""
BLOCK_SIDE = 128
"""The side of a :attr:`Fp8Format.BLOCK` block."""
MX_BLOCK = 32
"""Elements per :attr:`Fp8Format.MX` block, along the last dim."""
MIN_SCALE = 2.0**-126
"""The least fp32 scale of a block that is not all zero (the smallest normal fp32)."""
ZERO_BLOCK_SCALE = 1.0
"""The fp32 scale of an all-zero block (its e8m0 code is ``E8M0_BIAS``: 2**0)."""
E8M0_BIAS = 127
"""e8m0 code = exponent + ``E8M0_BIAS``; codes 0..254 are 2**-127 .. 2**127."""
E8M0_NAN = 0xFF
"""The e8m0 code of a block holding a NaN or an infinity."""
QUANTIZED_DTYPE = "float8_e4m3fn"
"""The wire dtype of a quantized tensor."""
SOURCE_DTYPES = ("bfloat16", "float16", "float32")
"""The wire dtypes a quantizer takes."""


def scale_dtype(fmt: Fp8Format) -> str:
    """The wire dtype of ``fmt``'s scales: ``float32``, or ``uint8`` (e8m0 codes) for MX."""
    return "uint8" if fmt is Fp8Format.MX else "float32"


def scale_shape(fmt: Fp8Format, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scales of a tensor of ``shape``: partial edge blocks count as blocks.

    Block: ``(ceil(rows / 128), ceil(cols / 128))``; tensor: ``()``; MX: the shape with its
    last dim ``ceil(last / 32)``.
    """
    if fmt is Fp8Format.BLOCK:
        rows, cols = shape
        return (math.ceil(rows / BLOCK_SIDE), math.ceil(cols / BLOCK_SIDE))
    if fmt is Fp8Format.TENSOR:
        return ()
    return (*shape[:-1], math.ceil(shape[-1] / MX_BLOCK))


def check_quantizable(
    fmt: Fp8Format, dtype: str, shape: tuple[int, ...], name: str | None = None
) -> None:
    """Raise :class:`MismatchError` (naming ``name``) if ``fmt`` cannot take this tensor.

    The dtype must be one of :data:`SOURCE_DTYPES`; a block tensor must be 2-D, any other at
    least 1-D; no dim may be 0.
    """
    if dtype not in SOURCE_DTYPES:
        raise MismatchError(f"{fmt.value} fp8 quantizes {SOURCE_DTYPES}, not {dtype}", tensor=name)
    if fmt is Fp8Format.BLOCK and len(shape) != 2:
        raise MismatchError(f"block fp8 needs a 2-D tensor, not shape {shape}", tensor=name)
    if not shape:
        raise MismatchError(f"{fmt.value} fp8 needs at least one dim", tensor=name)
    if 0 in shape:
        raise MismatchError(f"cannot quantize an empty tensor of shape {shape}", tensor=name)
