"""Small torch steps the delta encoder and decoder share, the same on CPU and CUDA.

None of them waits for the device unless it says so: sizes the host already knows are
passed in (``nonzero`` with a known count), and small host tables go to the device from
pinned memory without a synchronisation.
"""

from __future__ import annotations

import torch

from aiosync.delta.format import bits_dtype


def flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``'s elements as integers of their width (a copy if strided)."""
    return tensor.reshape(-1).view(bits_dtype(tensor.dtype))


def nonzero_flat(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Positions (int64) of the ``count`` set elements of the 1-D ``mask``, in order.

    ``count`` must be the true number (the caller knows it from the chunk table), which
    lets the device skip counting them again and the host skip waiting for the count.
    """
    try:
        found = torch.nonzero_static(mask, size=count)
    except (RuntimeError, NotImplementedError):  # a device without nonzero_static
        found = torch.nonzero(mask)
    return found.view(-1)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a small CPU tensor) on ``device``, copied from pinned memory without a wait."""
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


def pack_bits(bits: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """Pack a 1-D bool tensor (length a multiple of 8) into ``out`` (uint8), 8 per byte."""
    torch.sum(bits.view(torch.uint8).view(-1, 8) * weights, dim=1, dtype=torch.uint8, out=out)


def unpack_bits(packed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The bool tensor of ``8 * len(packed)`` bits that :func:`pack_bits` packed."""
    return (packed.view(-1, 1) & weights).view(-1).ne(0)
