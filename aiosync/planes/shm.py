"""The shared-memory data plane: POSIX shared memory segments mapped as ``uint8`` tensors.

A segment is a flat ``uint8`` tensor plus a plain-data handle (name and size) that another
process on this machine maps again. No sockets here.

Shared-memory segments live under ``/dev/shm`` as ``aiosync-<pidns>-<pid>-<token>``, where
``pidns`` identifies the creator's PID namespace. The sender unlinks its segments when it
closes; :func:`sweep_stale_segments` removes those left by killed processes of this
PID namespace (a pid from another namespace, say another container sharing ``/dev/shm``,
says nothing here) whenever a new segment is made.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, pack_bucket
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.private_dirs import pid_alive, pid_namespace

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "aiosync-"
_SHM_NAME = re.compile(r"^aiosync-(\d+)-(\d+)-[0-9a-f]{16}$")


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments whose creating process no longer exists; returns their names."""
    removed = []
    namespace = pid_namespace()
    for path in shm_dir.glob(SHM_PREFIX + "*"):
        match = _SHM_NAME.match(path.name)
        if match and int(match.group(1)) == namespace and not pid_alive(int(match.group(2))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.warning("removed %d shared-memory segments left by dead processes", len(removed))
    return removed


class ShmSegment:
    """A POSIX shared-memory segment mapped as a flat ``uint8`` tensor.

    The creator owns the name and unlinks it on :meth:`close`; the mapping itself lives as
    long as any tensor viewing it, in every process that mapped it.
    """

    def __init__(self, name: str, size: int, *, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._path = SHM_DIR / name
        self._tensor: torch.Tensor | None = torch.from_file(
            str(self._path), shared=True, size=size, dtype=torch.uint8
        )

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        """Create a named segment of ``size`` bytes, readable and writable by this user only."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        sweep_stale_segments()
        name = f"{SHM_PREFIX}{pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            _reserve(fd, size)
            return cls(name, size, owner=True)
        except BaseException:
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, handle: ShmHandle) -> ShmSegment:
        """Map a segment another process created; checks the name and size it claims."""
        if not _SHM_NAME.match(handle.name):
            raise AiosyncError(f"refusing shared-memory name {handle.name!r}")
        path = SHM_DIR / handle.name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise AiosyncError(f"shared-memory segment {handle.name} does not exist") from None
        if actual != handle.size:
            raise AiosyncError(
                f"shared-memory segment {handle.name} holds {actual} bytes, not {handle.size}"
            )
        return cls(handle.name, handle.size, owner=False)

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
        """Remove the name from ``/dev/shm``; existing mappings stay valid (idempotent)."""
        self._path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop this process's view, and the name too when this process created it."""
        if self.owner:
            self.unlink()
        self._tensor = None


def _reserve(fd: int, size: int) -> None:
    """Size a new segment and take its memory now, so a full ``/dev/shm`` fails here.

    ``ftruncate`` alone leaves the file sparse: on a small ``/dev/shm`` (64 MiB in a
    default container) the first write past what is free would kill the process (SIGBUS).
    """
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = os.statvfs(SHM_DIR)
        raise AiosyncError(
            f"cannot reserve {size} bytes of shared memory ({exc.strerror}); "
            f"{SHM_DIR} has {free.f_bavail * free.f_frsize} bytes free"
        ) from None


class ShmSenderPlane:
    """A ring of shared-memory segments the trainer packs into; engines map them by name.

    The names stay in ``/dev/shm`` while the plane is open, so engines may join at any time
    between versions; :meth:`close` unlinks them. Those of a trainer killed before it could
    are removed by the next plane made or closed on this machine
    (:func:`sweep_stale_segments`).
    """

    def __init__(self, count: int, capacity: int) -> None:
        self._segments: list[ShmSegment] = []
        try:
            for _ in range(count):
                self._segments.append(ShmSegment.create(capacity))
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
        """Nothing to do: engines map the same pages."""

    def close(self) -> None:
        """Unmap and unlink every segment."""
        for segment in self._segments:
            segment.close()
        self._segments.clear()


class ShmReceiverPlane:
    """An engine's mapping of a sender's segments."""

    def __init__(self, spec: ShmPlaneSpec) -> None:
        self._segments: list[ShmSegment] = []
        try:
            for handle in spec.buffers:
                self._segments.append(ShmSegment.attach(handle))
        except BaseException:
            self.close()
            raise

    def view(self, index: int, used: int) -> torch.Tensor:
        """The first ``used`` bytes of segment ``index``."""
        return self._segments[index].tensor[:used]

    def close(self) -> None:
        """Drop this engine's mappings (the sender owns the names).

        A session ends this way also when its trainer died; the names such a trainer left
        are swept here.
        """
        for segment in self._segments:
            segment.close()
        self._segments.clear()
        sweep_stale_segments()
