"""Many tiny copies in a few torch calls: the per-tensor cost of packing small tensors.

Copying a 4-byte tensor costs nothing; the call that copies it costs a few hundred
nanoseconds. :func:`pack_tiny` packs a bucket's one-dimensional tiny tensors of one dtype
with two calls (concatenate, then scatter to the buffer offsets), whatever their number.
Pure torch on CPU tensors; nothing here knows about the wire.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_UNITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtypes by width: bytes are scattered as integers, whatever their dtype (an index
copy of integers exists for every width, of float8 or complex values not always)."""


def pack_tiny(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    specs: Sequence[Any],
    groups: Mapping[str, list[int]],
) -> bytearray | None:
    """Copy each group of tiny one-dimensional ``tensors`` into a CPU ``buffer`` at once.

    ``groups`` maps a wire dtype name to the positions (in ``tensors`` and ``specs``) of
    whole tensors of that dtype; each spec gives its ``offset`` in ``buffer`` (flat
    ``uint8``) and its ``nbytes``. Returns a flag per spec, set for those copied, or None
    if no group could go this way (sources on another device, say); the caller copies
    the others one by one.
    """
    packed: bytearray | None = None
    for dtype, positions in groups.items():
        if len(positions) == len(specs):  # the whole bucket is one group
            sources, chosen = tensors, specs
        else:
            sources = [tensors[i] for i in positions]
            chosen = [specs[i] for i in positions]
        offsets = [spec.offset for spec in chosen]
        sizes = [spec.nbytes for spec in chosen]
        wanted = getattr(torch, dtype, None)
        if not isinstance(wanted, torch.dtype):
            continue
        if not scatter_bytes(buffer, sources, wanted, offsets, sizes):
            continue
        if packed is None:
            packed = bytearray(len(specs))
        for i in positions:
            packed[i] = 1
    return packed


def scatter_bytes(
    buffer: torch.Tensor,
    sources: Sequence[torch.Tensor],
    dtype: torch.dtype,
    offsets: list[int],
    sizes: list[int],
) -> bool:
    """Write one-dimensional ``sources`` of ``dtype`` to ``buffer`` at byte ``offsets``.

    ``sizes`` are their byte counts. Two calls whatever their number: a concatenation
    (which reads any layout: strided, conjugated or negated views) and one index copy.
    False, with nothing written, when they cannot go this way: another device or dtype
    than planned, sizes that no longer match, or offsets not aligned to the element width.
    """
    itemsize = dtype.itemsize
    width = 8 if itemsize % 8 == 0 else itemsize
    unit = _UNITS.get(width)
    if unit is None or buffer.storage_offset() % width or not sources:
        return False
    with torch.no_grad():
        try:
            flat = torch.cat(list(sources))
        except (RuntimeError, TypeError, ValueError):
            return False
        total = sum(sizes)
        if flat.dtype != dtype or flat.device != buffer.device or flat.nbytes != total:
            return False
        starts = _int64s(offsets)
        if starts.numel() and bool((starts % width).any()):
            return False
        starts //= width
        if total != width * len(sizes):  # not all one unit each: expand to every unit
            counts = _int64s(sizes) // width
            firsts = torch.cumsum(counts, 0) - counts
            index = torch.repeat_interleave(starts - firsts, counts)
            index += torch.arange(index.numel(), dtype=torch.int64)
        else:
            index = starts
        end = buffer.numel() // width * width
        target = buffer[:end].view(unit)
        target.index_copy_(0, index, flat.view(unit))
    return True


def _int64s(values: list[int]) -> torch.Tensor:
    """``values`` as an ``int64`` tensor, made through an array.

    ``torch.tensor`` of a list of Python ints costs about ten times as much.
    """
    return (
        torch.frombuffer(array("q", values), dtype=torch.int64)
        if values
        else torch.empty(0, dtype=torch.int64)
    )
