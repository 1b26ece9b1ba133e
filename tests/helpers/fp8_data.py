"""What the FP8 tests share: inputs with every hard case, and bit-for-bit comparisons.

A NaN in e4m3 output is ``0x7F`` or ``0xFF`` (its sign is not defined; see
``aiosync.transforms.fp8_reference``), and a NaN scale any NaN: the comparisons treat those
as equal and every other byte must be.
"""

from __future__ import annotations

import torch

from aiosync.transforms.fp8_formats import Fp8Format

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

SHAPES: dict[Fp8Format, list[tuple[int, ...]]] = {
    Fp8Format.BLOCK: [(128, 128), (256, 384), (130, 129), (1, 1), (127, 300), (5, 1000), (300, 7)],
    Fp8Format.TENSOR: [(77,), (1,), (128, 256), (33, 65), (2, 3, 5)],
    Fp8Format.MX: [(64,), (31,), (3, 33), (2, 5, 70), (130, 96), (4, 1)],
}
"""Shapes per format: whole blocks, partial edge blocks, one element, 1-D and 3-D."""


def random_weights(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu"
) -> torch.Tensor:
    """Normal values whose scale changes by row over 10**-6 .. 10**3, some rows all zero."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen)
    if values.dim() > 1:
        rows = values.shape[0]
        magnitude = 10.0 ** (torch.rand(rows, generator=gen) * 9 - 6)
        values *= magnitude.view(rows, *([1] * (values.dim() - 1)))
        values[torch.rand(rows, generator=gen) < 0.05] = 0.0
    return values.to(dtype).to(device)


def with_special_values(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with a NaN, an infinity, a -0.0 and subnormals at scattered positions."""
    flat = tensor.clone().reshape(-1)
    n = flat.numel()
    tiny = torch.finfo(tensor.dtype).tiny
    specials = [float("nan"), float("inf"), -0.0, tiny / 4, -tiny / 2]
    for i, value in enumerate(specials):
        flat[(i * 7919 + 13) % n] = value
    return flat.reshape(tensor.shape)


def assert_same_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3 codes equal byte for byte, a NaN of either sign matching a NaN."""
    got, want = got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)
    assert got.shape == want.shape, (got.shape, want.shape)
    got_nan, want_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    assert torch.equal(got_nan, want_nan), f"NaN at {int((got_nan ^ want_nan).sum())} places"
    differ = (got != want) & ~got_nan
    assert not differ.any(), (
        f"{int(differ.sum())} codes differ; first at {differ.nonzero()[0].tolist()}: "
        f"{int(got[differ][0])} against {int(want[differ][0])}"
    )


def assert_same_scales(got: torch.Tensor, want: torch.Tensor) -> None:
    """Scales equal bit for bit (fp32) or byte for byte (e8m0), a NaN matching a NaN."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if got.dtype == torch.uint8:
        assert torch.equal(got, want)
        return
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~got.isnan()
    assert torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))
