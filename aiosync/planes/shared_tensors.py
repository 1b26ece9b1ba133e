"""CPU tensors in one shared segment, which engines read directly (direct mode on CPU).

:func:`share_tensors` moves a module's parameters and buffers into one sealed memfd (see
:mod:`aiosync.planes.memfd`) and makes them views of it: the module trains as before, and
a sender in direct mode (``SenderConfig(direct=True)``) hands engines the segment once
instead of packing those tensors every version; each engine maps it read-only and copies
out of it. The segment lives as long as the module holds the returned
:class:`SharedTensors` (as the attribute :data:`ATTRIBUTE`) or until
:meth:`SharedTensors.close`: engines can open it only while it is open; the tensors stay
valid after it is closed (their pages go with their last view).

Once this process has mapped the memfd it is sealed with ``F_SEAL_FUTURE_WRITE`` (Linux
>= 5.1; a warning where the kernel refuses it): that mapping, which the tensors view, is
then the only way to change its bytes. Another process reaching it through
``/proc/<pid>/fd`` can neither map it writable nor ``write`` to it, so it cannot change
the weights engines read.

:func:`find_shared` is how a sender finds which open segment (if any) holds a tensor.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import ALIGNMENT, calculate_aligned_size, is_plain
from aiosync.core.wire import ShmHandle

ATTRIBUTE = "_aiosync_shared"
"""Where :func:`share_tensors` keeps the segment on the module (keeps it open)."""

_lock = threading.Lock()
_open: dict[int, weakref.ReferenceType[SharedTensors]] = {}  # base address -> segment
_bases: list[int] = []  # sorted keys of _open


@dataclass(frozen=True)
class SharedSpot:
    """Where a tensor lies in a shared segment: the segment's handle and the byte offset."""

    handle: ShmHandle
    offset: int


class SharedTensors:
    """One sealed memfd holding a module's tensors; open until :meth:`close` (idempotent)."""

    def __init__(self, size: int) -> None:
        from aiosync.planes.shm import ShmSegment

        self._segment: ShmSegment | None = ShmSegment.create(
            size, backend="memfd", seal_writes=True
        )
        self.size = size
        self.base = self._segment.tensor.data_ptr()
        self.names: list[str] = []
        with _lock:
            _open[self.base] = weakref.ref(self)
            bisect.insort(_bases, self.base)
        self._finalizer = weakref.finalize(self, _forget, self.base, self._segment)

    @property
    def handle(self) -> ShmHandle:
        """The segment's name and size, from which an engine opens it (read-only)."""
        if self._segment is None:
            raise AiosyncError("shared tensors are closed")
        return self._segment.handle

    @property
    def closed(self) -> bool:
        """Whether engines can no longer open the segment."""
        return self._segment is None

    def view(self, offset: int, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of ``tensor``'s dtype and shape at ``offset`` of the segment, filled."""
        assert self._segment is not None
        raw = self._segment.tensor[offset : offset + tensor.nbytes]
        out = raw.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def close(self) -> None:
        """Let no engine open the segment again (the tensors stay valid); idempotent."""
        self._segment = None
        self._finalizer()

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _forget(base: int, segment: object) -> None:
    with _lock:
        if _open.pop(base, None) is not None:
            _bases.remove(base)
    close = getattr(segment, "close", None)
    if close is not None:
        close()


def share_tensors(module: torch.nn.Module) -> SharedTensors:
    """Move ``module``'s CPU parameters and buffers into one new shared segment.

    Each becomes a view of the segment (``tensor.data`` is replaced; gradients and
    optimizer state are untouched, so build the optimizer after or keep it as is: it holds
    the same parameter objects). Tied tensors stay tied. Returns the segment, also kept on
    the module as :data:`ATTRIBUTE`; a second call on the same module is refused. Raises
    :class:`AiosyncError` if sealed memfds cannot be made here, :class:`ValueError` for a
    tensor that is not on the CPU.
    """
    if getattr(module, ATTRIBUTE, None) is not None:
        raise AiosyncError("this module's tensors are already shared")
    tensors: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) in seen or tensor.numel() == 0:
            continue
        seen.add(id(tensor))
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; share_tensors moves CPU tensors")
        tensors.append((name, tensor))
    size = sum(calculate_aligned_size(t.nbytes) for _, t in tensors) or ALIGNMENT
    shared = SharedTensors(size)
    offset = 0
    with torch.no_grad():
        for name, tensor in tensors:
            tensor.data = shared.view(offset, tensor.detach())
            shared.names.append(name)
            offset += calculate_aligned_size(tensor.nbytes)
    setattr(module, ATTRIBUTE, shared)
    return shared


def find_shared(tensor: torch.Tensor) -> SharedSpot | None:
    """The open shared segment holding ``tensor`` whole (plain CPU tensors only), or None."""
    if tensor.device.type != "cpu" or not is_plain(tensor):
        return None
    address, nbytes = tensor.data_ptr(), tensor.nbytes
    with _lock:
        at = bisect.bisect_right(_bases, address) - 1
        ref = _open.get(_bases[at]) if at >= 0 else None
    shared = ref() if ref is not None else None
    segment = None if shared is None else shared._segment  # read once: close may race
    if shared is None or segment is None:
        return None
    offset = address - shared.base
    if offset + nbytes > shared.size:
        return None
    return SharedSpot(segment.handle, offset)
