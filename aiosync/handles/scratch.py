"""A grow-only byte buffer reused from bucket to bucket (one per rank's thread)."""

from __future__ import annotations

import torch


class Scratch:
    """Hands out a flat ``uint8`` buffer of at least the asked size, reusing the last one.

    Buckets of a sync differ in size; asking the allocator for a fresh buffer each time
    costs a device allocation (milliseconds on CUDA) whenever no cached block fits. The
    caller must be done with the previous bucket (its copies synchronized) before asking.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer of exactly ``max(nbytes, 1)`` bytes on ``device`` (a view of the kept one)."""
        size = max(nbytes, 1)
        buffer = self._buffer
        if buffer is None or buffer.numel() < size or buffer.device != device:
            self._buffer = None  # free the old one first
            buffer = self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
        return buffer[:size]

    def clear(self) -> None:
        """Drop the kept buffer."""
        self._buffer = None
