"""Versions that differ from a base in a chosen number of elements, for the delta tests."""

from __future__ import annotations

import torch

from aiosync.delta.ops import flat_bits


def changed_copy(
    base: torch.Tensor, density: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``base`` with ``round(density * numel)`` elements' bits changed, and where.

    Bits are flipped in the element's integer width (so floats may become NaNs or -0.0, as
    they may in a real step); a bool changes between 0 and 1. Returns the copy and the
    positions changed (sorted, int64, on the CPU).
    """
    gen = torch.Generator().manual_seed(seed)
    new = base.clone()
    bits = flat_bits(new)
    n = bits.numel()
    where = torch.randperm(n, generator=gen)[: round(density * n)].sort().values
    if base.dtype == torch.bool:
        flips = torch.ones(len(where), dtype=torch.uint8)
    else:
        flips = torch.randint(1, 127, (len(where),), generator=gen)
    flips = flips.to(bits.dtype).to(bits.device)
    device_where = where.to(bits.device)
    bits[device_where] = bits[device_where] ^ flips
    return new, where


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of random bits of ``dtype`` (any bit pattern, NaNs included; bools 0 or 1)."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def known_version() -> list[torch.Tensor]:
    """Whole rows, a tiny tensor and a tensor with a short last row, for a fixed digest."""
    return [
        torch.arange(100_000, dtype=torch.int32),
        torch.arange(7, dtype=torch.uint8),
        torch.arange(300_000, dtype=torch.int64).to(torch.bfloat16).view(-1, 1000),
    ]


KNOWN_DIGEST = "efdfcd9c279a88d4"
"""The digest of ``known_version()``: it changes only with the digest's definition (and
then every peer must change with it)."""
