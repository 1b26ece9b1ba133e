"""The fast FP8 quantizer the packer calls: one tensor into its destination views.

:func:`quantize_into` reads a bf16, fp16 or fp32 tensor (CPU or CUDA, any strides) and
writes its e4m3 values and scales straight into views of a packing buffer, bit for bit what
:mod:`aiosync.transforms.fp8_reference` computes (its conventions; ``docs/fp8.md``). Torch
ops vectorised per block: a reduction for each block's amax (no temporary), the small scale
tensor, then one division whose result is cast on store into the destination (on CUDA one
kernel; on CPU torch stages it). MX multiplies, saturates and casts in bounded chunks. On
CUDA with Triton importable, the 128 x 128 block format is one Triton kernel instead
(:mod:`aiosync.transforms.fp8_triton`): each block read once.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from aiosync.core.errors import MismatchError
from aiosync.core.layout import dtype_name
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
    scale_dtype,
    scale_shape,
)
from aiosync.transforms.fp8_triton import quantize_block_triton, triton_can_run

Kernel = Literal["auto", "torch", "triton"]
"""Which implementation quantizes: ``auto`` takes Triton where it can run, else torch."""

MX_CHUNK_BYTES = 64 << 20
"""The most fp32 bytes MX stages at once (its multiply, saturate and cast)."""

_INF = math.inf


def quantize_into(
    tensor: torch.Tensor,
    fmt: Fp8Format,
    out: torch.Tensor,
    scales: torch.Tensor,
    *,
    kernel: Kernel = "auto",
    name: str | None = None,
) -> None:
    """Quantize ``tensor`` in ``fmt``, writing e4m3 values into ``out``, scales into ``scales``.

    ``out`` is a contiguous ``uint8`` or ``float8_e4m3fn`` tensor of ``tensor.numel()``
    elements; ``scales`` a contiguous tensor of the format's scale dtype and element count,
    or ``uint8`` of its bytes (a view of a packing buffer). All three on one device.
    :class:`MismatchError` (naming ``name``) for a tensor or destination that does not fit.
    """
    shape = tuple(tensor.shape)
    check_quantizable(fmt, dtype_name(tensor.dtype), shape, name)
    tensor = tensor.detach()  # a trainer's parameter: ``out=`` takes no autograd input
    values = _destination(out, torch.float8_e4m3fn, shape, name)
    dtype = torch.uint8 if scale_dtype(fmt) == "uint8" else torch.float32
    scale_view = _destination(scales, dtype, scale_shape(fmt, shape), name)
    if not tensor.device == values.device == scale_view.device:
        raise MismatchError(
            f"tensor on {tensor.device}, out on {values.device}, scales on {scale_view.device}",
            tensor=name,
        )
    if kernel == "triton" and not (fmt is Fp8Format.BLOCK and triton_can_run(tensor)):
        raise MismatchError(
            "the Triton quantizer takes blocks of a CUDA tensor, with triton installed",
            tensor=name,
        )
    if fmt is Fp8Format.BLOCK:
        if kernel != "torch" and triton_can_run(tensor):
            quantize_block_triton(tensor, values, scale_view)
        else:
            _quantize_block(tensor, values, scale_view)
    elif fmt is Fp8Format.TENSOR:
        _quantize_tensor(tensor, values, scale_view)
    else:
        _quantize_mx(tensor, values, scale_view)


def quantize(
    tensor: torch.Tensor, fmt: Fp8Format, *, kernel: Kernel = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` quantized in ``fmt`` into new tensors on its device: (e4m3, scales)."""
    shape = tuple(tensor.shape)
    check_quantizable(fmt, dtype_name(tensor.dtype), shape)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=tensor.device)
    dtype = torch.uint8 if scale_dtype(fmt) == "uint8" else torch.float32
    scales = torch.empty(scale_shape(fmt, shape), dtype=dtype, device=tensor.device)
    quantize_into(tensor, fmt, out, scales, kernel=kernel)
    return out, scales


def _destination(
    view: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str | None
) -> torch.Tensor:
    """``view`` as a contiguous tensor of ``dtype`` and ``shape`` (its bytes reinterpreted)."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    fits = view.is_contiguous() and (
        (view.dtype == dtype and view.numel() == numel)
        or (view.dtype == torch.uint8 and view.numel() == numel * itemsize)
    )
    if not fits:
        raise MismatchError(
            f"destination of {view.numel()} {view.dtype} (contiguous: {view.is_contiguous()}) "
            f"cannot hold {numel} {dtype}",
            tensor=name,
        )
    if view.storage_offset() * view.element_size() % itemsize:
        raise MismatchError(f"destination of {dtype} is not {itemsize}-byte aligned", tensor=name)
    return view.reshape(-1).view(dtype).view(shape)


def _spans(length: int, block: int) -> list[tuple[slice, slice, int, int]]:
    """The whole blocks of a dim, then its partial edge block: (elements, blocks, count, size)."""
    whole = length // block
    spans = []
    if whole:
        spans.append((slice(0, whole * block), slice(0, whole), whole, block))
    if length > whole * block:
        spans.append((slice(whole * block, length), slice(whole, whole + 1), 1, length % block))
    return spans


@functools.cache
def _e4m3_max(device: torch.device) -> torch.Tensor:
    # a tensor divisor: CUDA divides by a Python number as a multiplication by its reciprocal
    return torch.full((1,), E4M3_MAX, dtype=torch.float32, device=device)


def _e4m3_scales(amax: torch.Tensor, out: torch.Tensor) -> None:
    """fp32 scales into ``out``: amax / 448, at least 2**-126, 1 for an all-zero block."""
    torch.div(amax, _e4m3_max(amax.device), out=out)  # fp32 math: the divisor is fp32
    out.clamp_(min=MIN_SCALE)  # keeps NaN and inf
    out.masked_fill_(amax == 0, ZERO_BLOCK_SCALE)


def _quantize_block(tensor: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    rows, cols = tensor.shape
    for row_span, row_blocks, row_count, height in _spans(rows, BLOCK_SIDE):
        for col_span, col_blocks, col_count, width in _spans(cols, BLOCK_SIDE):
            blocks = (row_count, height, col_count, width)
            source = tensor[row_span, col_span].view(blocks)  # splitting dims: always a view
            block_scales = scales[row_blocks, col_blocks]
            _e4m3_scales(torch.linalg.vector_norm(source, _INF, dim=(1, 3)), block_scales)
            target = out[row_span, col_span].view(blocks)
            torch.div(source, block_scales[:, None, :, None], out=target)


def _quantize_tensor(tensor: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    scale = scales.view(1)  # a tensor operand with a dim: fp32 math for a bf16 tensor
    _e4m3_scales(torch.linalg.vector_norm(tensor, _INF), scale)
    torch.div(tensor, scale, out=out)


def _mx_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e8m0 codes and the factors ``2**-e`` (NaN for a non-finite block) from block amaxes."""
    amax = amax.to(torch.float32)
    exponent = torch.frexp(amax).exponent - 1 - E4M3_EMAX  # floor(log2 amax) - emax_elem
    exponent = exponent.clamp_(-E8M0_BIAS, E8M0_BIAS).masked_fill_(amax == 0, 0)
    finite = amax.isfinite()
    codes = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    factors = ((E8M0_BIAS - exponent) << 23).view(torch.float32)  # 2**-e, built exactly
    return codes, factors.masked_fill_(~finite, math.nan)


def _quantize_mx(tensor: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    length = tensor.shape[-1]
    rows = tensor.reshape(-1, length)
    out_rows = out.view(-1, length)
    scale_rows = scales.view(rows.shape[0], -1)
    chunk = max(1, MX_CHUNK_BYTES // (4 * length))
    for span, blocks, count, width in _spans(length, MX_BLOCK):
        source = rows[:, span].view(-1, count, width)
        amax = torch.linalg.vector_norm(source, _INF, dim=2)
        codes, factors = _mx_scales(amax)
        scale_rows[:, blocks] = codes
        target = out_rows[:, span].view(-1, count, width)
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            scaled = torch.mul(source[part], factors[part, :, None])  # exact: a power of two
            target[part] = scaled.clamp_(-E4M3_MAX, E4M3_MAX)
