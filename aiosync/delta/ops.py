"""Small torch steps the delta encoder and decoder share, the same on CPU and CUDA.

None of them waits for the device unless it says so: sizes the host already knows are
passed in (``nonzero`` with a known count), and small host tables go to the device from
pinned memory without a synchronisation.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy.typing as npt
import torch

from aiosync.delta.format import bits_dtype


def flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``'s elements as integers of their width (a copy if strided)."""
    return tensor.reshape(-1).view(bits_dtype(tensor.dtype))


def nonzero_flat(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Positions (int64) of the ``count`` set elements of the 1-D ``mask``, in order.

    ``count`` must be the true number (the caller knows it from the chunk table), which
    lets a CUDA device skip counting them again and the host skip waiting for the count.
    """
    if mask.device.type == "cpu":  # nothing to wait for, and plain nonzero is faster there
        return torch.nonzero(mask).view(-1)
    try:
        found = torch.nonzero_static(mask, size=count)
    except (RuntimeError, NotImplementedError):  # a device without nonzero_static
        found = torch.nonzero(mask)
    return found.view(-1)


def to_device(host: torch.Tensor | npt.NDArray[Any], device: torch.device) -> torch.Tensor:
    """``host`` (a small CPU tensor or array) on ``device``, from pinned memory, no wait."""
    if not isinstance(host, torch.Tensor):
        host = torch.from_numpy(host)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A small device tensor copied to the host, waited for only when read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            self._host, self._event = tensor, None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record()

    def get(self) -> torch.Tensor:
        """The host copy (waits for the device to have written it)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


_SPREAD = 0x8040201008040201 - (1 << 64)  # bits 0, 9, 18, ..., 63 (as a signed int64)


def pack_bits(bits: torch.Tensor, out: torch.Tensor) -> None:
    """Pack a flat bool tensor (length a multiple of 8, 8-byte aligned) into ``out`` (uint8).

    Eight elements a byte, the first in the most significant bit. Each group of eight bools
    is read as one int64 whose bytes are 0 or 1; one product moves those bits into its top
    byte with no two partial products overlapping (so no carries), and the shift and the
    conversion to uint8 keep that byte: three passes over an eighth of the elements.
    """
    words = bits.view(torch.uint8).view(torch.int64) * _SPREAD
    words >>= 56
    out.copy_(words)  # an integer conversion keeps the low byte


@lru_cache(maxsize=16)
def _byte_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte value: its eight bits as bools (most significant first), its set bits."""
    values = torch.arange(256, dtype=torch.int64)
    bits = (values.view(-1, 1) >> torch.arange(7, -1, -1)) & 1
    return bits.bool().to(device), bits.sum(1).to(torch.uint8).to(device)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The flat bool tensor of ``8 * len(packed)`` elements that :func:`pack_bits` packed."""
    return _byte_tables(packed.device)[0][packed.to(torch.int32)].view(-1)


def set_bits(packed: torch.Tensor) -> torch.Tensor:
    """The number of set bits of each byte of ``packed`` (uint8, same shape)."""
    return _byte_tables(packed.device)[1][packed.to(torch.int32)]


_LOW_BITS = 0x0101010101010101


def count_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """The set elements of each row of a 2-D bool tensor, into ``out`` (int32 or int64).

    On the CPU, eight bools are summed as one int64 (one product puts their sum in the
    top byte); CUDA reduces the bools directly.
    """
    if rows.device.type != "cpu" or rows.shape[1] % 8:
        torch.sum(rows, 1, dtype=out.dtype, out=out)
        return
    words = rows.view(torch.uint8).view(torch.int64) * _LOW_BITS
    words >>= 56
    torch.sum(words, 1, dtype=out.dtype, out=out)
