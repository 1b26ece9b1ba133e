"""The 128 x 128 block FP8 quantizer as one Triton kernel: each block read once, on CUDA.

One program per block loads it (masked at the edges: a partial block's amax is its own
elements'), computes its amax, its scale and its values with the conventions of
:mod:`aiosync.transforms.fp8_reference` (IEEE division: ``tl.math.div_rn``; the cast rounds to
nearest even), and stores both. Imported only where ``triton`` is; :func:`triton_can_run`
says whether it may be used for a tensor.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from aiosync.transforms.fp8_formats import BLOCK_SIDE, E4M3_MAX, MIN_SCALE, ZERO_BLOCK_SCALE

TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None
"""Whether ``triton`` is installed (the kernel is compiled on first use)."""


FP8_CAPABILITY = (8, 9)
"""The least CUDA compute capability with e4m3 conversions (Ada, Hopper and later)."""


def triton_can_run(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is on a CUDA device with e4m3 conversions and Triton is installed."""
    if not (TRITON_IMPORTABLE and tensor.is_cuda):
        return False
    return torch.cuda.get_device_capability(tensor.device) >= FP8_CAPABILITY


def quantize_block_triton(tensor: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize 2-D ``tensor`` into contiguous ``out`` (e4m3) and ``scales`` (fp32 blocks)."""
    rows, cols = tensor.shape
    grid = (scales.shape[0], scales.shape[1])
    with torch.cuda.device(tensor.device):
        _kernel()[grid](
            tensor,
            out,
            scales,
            rows,
            cols,
            tensor.stride(0),
            tensor.stride(1),
            BLOCK=BLOCK_SIDE,
            E4M3_MAX=E4M3_MAX,
            MIN_SCALE=MIN_SCALE,
            ZERO_SCALE=ZERO_BLOCK_SCALE,
            num_warps=8,
        )


_COMPILED: list[Any] = []


def _kernel() -> Any:
    """The jitted kernel, defined on first use (``triton`` imported only then)."""
    if _COMPILED:
        return _COMPILED[0]
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc, untyped-decorator]
    def block_quantize(  # type: ignore[no-untyped-def]
        x_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        row_stride,
        col_stride,
        BLOCK: tl.constexpr,
        E4M3_MAX: tl.constexpr,
        MIN_SCALE: tl.constexpr,
        ZERO_SCALE: tl.constexpr,
    ):
        block_row = tl.program_id(0)
        block_col = tl.program_id(1)
        r = (block_row * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        c = (block_col * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        source = x_ptr + r[:, None] * row_stride + c[None, :] * col_stride
        x = tl.load(source, mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)  # tl.max drops NaN
        scale = tl.maximum(tl.math.div_rn(amax, E4M3_MAX), MIN_SCALE)
        scale = tl.where(amax == 0.0, ZERO_SCALE, scale)
        scale = tl.where(nans > 0, float("nan"), scale)
        values = tl.math.div_rn(x, scale).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        tl.store(q_ptr + r[:, None] * cols + c[None, :], values, mask=inside)
        tl.store(s_ptr + block_row * tl.num_programs(1) + block_col, scale)

    _COMPILED.append(block_quantize)
    return block_quantize
