"""The shared-memory data plane: segments of this host's memory mapped as ``uint8`` tensors.

A segment is a flat ``uint8`` tensor plus a plain-data handle (``ShmHandle``: a name and a
size) from which another process on this machine reaches the same memory. No sockets here.

An engine must not trust the handle: the peer that sent it may name a file it planted, swap
a name between a check and a map, or shrink the file under the engine's mapping (a read of
a mapped page past the end of a file kills the process with SIGBUS; no Python error).
ZMQ cannot pass descriptors, so a segment is one of two kinds, each in its own module,
which says how it is made and how an engine opens and checks it:

- a sealed memfd (:mod:`aiosync.planes.memfd`), what a trainer's data plane makes by
  default: it cannot shrink, so an engine maps it (zero copies);
- a file in ``/dev/shm`` (:mod:`aiosync.planes.shm_files`), the fallback: it can shrink,
  so an engine never maps one but reads each bucket out of it (one copy).

This module holds what spans both kinds: :class:`ShmSegment` (making, mapping and closing
a segment of either kind), :func:`open_segment` (opening a peer's segment by name, checked
on the descriptor), the choice of kind for a trainer's plane (``AIOSYNC_SHM_BACKEND``), and
the two planes, :class:`ShmSenderPlane` and :class:`ShmReceiverPlane`. docs/security.md
("Shared memory") says the same for operators.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from typing import Literal

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, pack_bucket
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.planes.base import BucketContext, ReceiverPlane, SenderPlane
from aiosync.planes.memfd import (
    BACKEND_ENV,
    MEMFD_NAME,
    create_memfd,
    memfd_available,
    open_memfd_segment,
)
from aiosync.planes.shm_files import (
    FILE_NAME,
    SHM_DIR,
    CopiedFileBuffer,
    check_claimed_size,
    check_used,
    create_file_segment,
    map_segment,
    open_file_segment,
    shown_name,
    sweep_stale_segments,
)
from aiosync.private_dirs import pid_namespace

log = logging.getLogger(__name__)

Backend = Literal["memfd", "file"]


# --------------------------------------------------------------------------------------
# the kind of segment a trainer's plane makes
# --------------------------------------------------------------------------------------


def _backend(requested: Backend | None) -> Backend:
    wanted = requested or os.environ.get(BACKEND_ENV, "").strip().lower() or None
    if wanted not in (None, "memfd", "file"):
        raise AiosyncError(f"{BACKEND_ENV} is {shown_name(wanted)}; use memfd or file")
    if wanted == "file":
        return "file"
    if memfd_available():
        return "memfd"
    if wanted == "memfd":
        raise AiosyncError("sealed memfds cannot be made here (memfd_create or sealing failed)")
    _warn_fallback()
    return "file"


@functools.cache
def _warn_fallback() -> None:
    log.warning(
        "sealed memfds are unavailable; shared-memory segments are files in %s (engines "
        "copy each bucket out of them)",
        SHM_DIR,
    )


# --------------------------------------------------------------------------------------
# opening a peer's segment
# --------------------------------------------------------------------------------------


def open_segment(
    handle: ShmHandle, *, max_size: int | None, writable: bool = False
) -> tuple[int, Backend]:
    """Open a peer's segment once and check it on the descriptor; returns it and its kind.

    The descriptor is read-only unless ``writable`` (then a memfd sealed against writes is
    refused). Raises :class:`AiosyncError` naming the segment and what is wrong with it. The caller
    owns the descriptor.
    """
    name = handle.name
    if not isinstance(name, str):
        raise AiosyncError(f"refusing shared-memory name {shown_name(name)}")
    if match := MEMFD_NAME.fullmatch(name):
        size = check_claimed_size(name, handle.size, max_size)
        return open_memfd_segment(name, size, match, writable=writable), "memfd"
    if FILE_NAME.fullmatch(name):
        size = check_claimed_size(name, handle.size, max_size)
        return open_file_segment(name, size, writable=writable), "file"
    raise AiosyncError(f"refusing shared-memory name {shown_name(name)}")


# --------------------------------------------------------------------------------------
# segments
# --------------------------------------------------------------------------------------


class ShmSegment:
    """A shared-memory segment mapped as a flat ``uint8`` tensor.

    The creator owns the segment: :meth:`close` unlinks a file's name, or closes the
    descriptor through which others open a memfd. The mapping itself lives as long as any
    tensor viewing it, in every process that mapped it.
    """

    def __init__(
        self,
        name: str,
        size: int,
        tensor: torch.Tensor,
        *,
        owner: bool,
        backend: Backend,
        fd: int | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.backend: Backend = backend
        self._fd = fd  # a memfd creator's descriptor, which the name points at
        self._tensor: torch.Tensor | None = tensor

    @classmethod
    def create(
        cls, size: int, *, backend: Backend = "file", seal_writes: bool = False
    ) -> ShmSegment:
        """Make a segment of ``size`` bytes, readable and writable by this user only.

        ``backend``: ``"file"``, a name in ``/dev/shm`` (the default, which any process of
        this user sharing that directory can open, as :mod:`aiosync.compat.teacher` needs),
        or ``"memfd"``, sealed against resizing (what a trainer's data plane makes where it
        can: see :class:`ShmSenderPlane`). The memory is taken now: too little of it is an
        :class:`AiosyncError` saying how much was needed and how much is free, before
        anything is made.

        ``seal_writes`` (memfds only; files cannot be sealed): seal it against writes
        through anything but this segment's own view (``F_SEAL_FUTURE_WRITE``, Linux >=
        5.1, skipped on older kernels), so no other process can change its bytes; others
        can then attach it only read-only.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        if backend not in ("memfd", "file"):
            raise ValueError(f"no shared-memory backend {backend!r}")
        if backend == "memfd" and not memfd_available():
            raise AiosyncError("sealed memfds cannot be made here (memfd_create or sealing failed)")
        sweep_stale_segments()
        token = secrets.token_hex(8)
        stem = f"{pid_namespace()}-{os.getpid()}-{token}"
        if backend == "memfd":
            name, fd, tensor = create_memfd(size, stem, seal_writes=seal_writes)
            return cls(name, size, tensor, owner=True, backend="memfd", fd=fd)
        name, tensor = create_file_segment(size, stem)
        return cls(name, size, tensor, owner=True, backend="file")

    @classmethod
    def attach(
        cls, handle: ShmHandle, *, max_size: int | None = None, writable: bool = True
    ) -> ShmSegment:
        """Map a segment another process made, after checking it (see :func:`open_segment`).

        ``max_size``: the most bytes the caller accepts (the claimed size must also be the
        segment's real size, so without it nothing bigger than what exists is mapped).
        ``writable=False`` opens and maps it read-only (``PROT_READ``): a write through the
        tensor is then a SIGSEGV in this process, never a change to the creator's memory.

        A memfd segment is sealed and cannot fault. A file segment is mapped too, and its
        creator could shrink it under the mapping: use this only for segments of a trusted
        creator. :class:`ShmReceiverPlane`, which trusts no peer, never maps a file.
        """
        fd, kind = open_segment(handle, max_size=max_size, writable=writable)
        try:
            tensor = map_segment(fd, handle.size, writable=writable)
        except (OSError, ValueError) as exc:
            raise AiosyncError(
                f"cannot map shared-memory segment {shown_name(handle.name)}: {exc}"
            ) from None
        finally:
            os.close(fd)
        return cls(handle.name, handle.size, tensor, owner=False, backend=kind)

    @property
    def tensor(self) -> torch.Tensor:
        """The mapped bytes; raises once the segment is closed."""
        if self._tensor is None:
            raise AiosyncError(f"shared-memory segment {self.name} is closed")
        return self._tensor

    @property
    def handle(self) -> ShmHandle:
        """The segment's name and size."""
        return ShmHandle(name=self.name, size=self.size)

    def unlink(self) -> None:
        """Let no new process open the segment; existing mappings stay valid (idempotent).

        A file's name leaves ``/dev/shm``; a memfd creator closes the descriptor its name
        points at.
        """
        if self.backend == "file":
            (SHM_DIR / self.name).unlink(missing_ok=True)
        elif self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        """Drop this process's view, and the name too when this process created it."""
        if self.owner:
            self.unlink()
        self._tensor = None


# --------------------------------------------------------------------------------------
# planes
# --------------------------------------------------------------------------------------


class ShmSenderPlane(SenderPlane):
    """A ring of shared-memory segments the trainer packs into; engines open them by name.

    ``backend``: by default :data:`~aiosync.planes.memfd.BACKEND_ENV` (``memfd`` or
    ``file``) if set, else sealed memfds where they can be made, else files (with a
    warning: engines then copy each bucket out); memfds are sealed against writes by
    anyone but this plane (``seal_writes``). The segments stay open while the plane
    is, so engines may join at any time between versions; :meth:`close` closes them.
    Memfds go with the trainer's process; files of a trainer killed before it could unlink
    them are removed by the next plane made or closed on this machine
    (:func:`~aiosync.planes.shm_files.sweep_stale_segments`).
    """

    def __init__(self, count: int, capacity: int, *, backend: Backend | None = None) -> None:
        kind = _backend(backend)
        self._segments: list[ShmSegment] = []
        try:
            for _ in range(count):
                self._segments.append(ShmSegment.create(capacity, backend=kind, seal_writes=True))
        except BaseException:
            self.close()
            raise
        self._capacity = capacity

    @property
    def spec(self) -> ShmPlaneSpec:
        """The segments' names and sizes."""
        return ShmPlaneSpec([segment.handle for segment in self._segments])

    @property
    def capacity(self) -> int:
        """Bytes of each segment."""
        return self._capacity

    @property
    def count(self) -> int:
        """Number of segments."""
        return len(self._segments)

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Copy the bucket into segment ``index`` (a memcpy per tensor)."""
        pack_bucket(self._segments[index].tensor, plan)

    async def publish(self, index: int, used: int) -> None:
        """Nothing to do: engines reach the same pages."""

    def close(self) -> None:
        """Unmap every segment and let no engine open it again."""
        for segment in self._segments:
            segment.close()
        self._segments.clear()


class _MappedBuffer:
    """A sealed memfd, mapped read-only: a bucket is a view of its first bytes (zero copies).

    Nothing may write into a view: the pages are ``PROT_READ`` (a write is a SIGSEGV).
    """

    def __init__(self, segment: ShmSegment) -> None:
        self._segment = segment

    def view(self, used: int) -> torch.Tensor:
        segment = self._segment
        return segment.tensor[: check_used(segment.name, segment.size, used)]

    def close(self) -> None:
        self._segment.close()


class ShmReceiverPlane(ReceiverPlane):
    """An engine's hold on a sender's segments: sealed memfds mapped, files read (one copy).

    Both are opened read-only: memfds are mapped ``PROT_READ`` (a view must never be
    written into), files are read into this engine's own buffers. Each segment is opened
    and checked as :mod:`aiosync.planes.memfd` (memfds) or :mod:`aiosync.planes.shm_files`
    (files in ``/dev/shm``) describes.

    ``max_buffers`` and ``max_bytes`` bound what one peer's plane may name (an engine passes
    its limits; ``None``: no bound here beyond the segments' real sizes). Anything refused
    is an :class:`AiosyncError` and leaves nothing open.
    """

    views_at_once = True  # a view never waits on the host (engine.quick_apply)

    def __init__(
        self,
        spec: ShmPlaneSpec,
        *,
        max_buffers: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self._buffers: list[_MappedBuffer | CopiedFileBuffer] = []
        handles = spec.buffers
        if max_buffers is not None and len(handles) > max_buffers:
            raise AiosyncError(
                f"a shared-memory plane of {len(handles)} segments is over the limit of "
                f"{max_buffers}"
            )
        for handle in handles:
            check_claimed_size(handle.name, handle.size, max_bytes)
        total = sum(handle.size for handle in handles)
        if max_bytes is not None and total > max_bytes:
            raise AiosyncError(
                f"a shared-memory plane of {total} bytes is over the limit of {max_bytes}"
            )
        try:
            for handle in handles:
                if isinstance(handle.name, str) and MEMFD_NAME.fullmatch(handle.name):
                    segment = ShmSegment.attach(handle, max_size=max_bytes, writable=False)
                    self._buffers.append(_MappedBuffer(segment))
                else:
                    fd, _ = open_segment(handle, max_size=max_bytes, writable=False)
                    self._buffers.append(CopiedFileBuffer(handle.name, handle.size, fd))
        except BaseException:
            self.close()
            raise

    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        """The first ``used`` bytes of segment ``index`` (checked against its size)."""
        if not isinstance(index, int) or not 0 <= index < len(self._buffers):
            raise AiosyncError(f"no shared-memory segment {shown_name(index)} in this plane")
        return self._buffers[index].view(used)

    def close(self) -> None:
        """Drop this engine's hold (the sender owns the segments); idempotent.

        A session ends this way also when its trainer died; the files such a trainer left
        are swept here.
        """
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()
        sweep_stale_segments()
