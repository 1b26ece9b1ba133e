"""Shared-memory segments as files in ``/dev/shm``, and the checks every segment passes.

Files in ``/dev/shm`` are the fallback to sealed memfds (:mod:`aiosync.planes.memfd`):
``aiosync-<pidns>-<pid>-<token>``, made with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600,
reserved with ``posix_fallocate`` after a ``statvfs`` check. A data plane makes these where
memfds cannot be made and sealed, or when ``AIOSYNC_SHM_BACKEND=file`` asks for them (an
engine in another PID namespace that shares this ``/dev/shm``); they are also
:meth:`~aiosync.planes.shm.ShmSegment.create`'s default. A file cannot be sealed, so an
engine never maps one: :class:`~aiosync.planes.shm.ShmReceiverPlane` opens the name once
(:func:`open_file_segment`), read-only, relative to a descriptor of ``/dev/shm``, with
``O_NOFOLLOW`` and without ``O_CREAT``, checks the descriptor (regular file, this user's,
mode 0600, one link, the claimed size) and reads each bucket with ``preadv`` from that
descriptor into its own buffer (:class:`CopiedFileBuffer`), after checking the size again: a
file shrunk at any moment makes a short read and an :class:`AiosyncError`, never a SIGBUS.
The price is one copy per bucket on the engine (about the cost of a memcpy) and the engine's
own buffer per segment. :meth:`~aiosync.planes.shm.ShmSegment.attach` does map such a file
(the teacher buffers of :mod:`aiosync.compat.teacher` share writes both ways): its creator
must be trusted not to shrink it.

The sender unlinks its files when it closes; :func:`sweep_stale_segments` removes those
left by killed processes of this PID namespace (a pid from another namespace, say another
container sharing ``/dev/shm``, says nothing here) whenever a segment is made or an
engine's plane closes. docs/security.md ("Shared memory") says the same for operators.

Also here, because sealed memfds use them too: the checks on a segment's descriptor and
claimed size, reserving a new segment's memory after a free-space check, mapping a
descriptor as a tensor, and the parts of the names both kinds share.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import stat
from pathlib import Path

import numpy
import torch

from aiosync.core.errors import AiosyncError
from aiosync.private_dirs import dead_entries

# the logger name these records had before this module was split out of shm.py
log = logging.getLogger("aiosync.planes.shm")

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "aiosync-"

MODE = 0o600
# Bounded digit counts: a planted name can't make int() slow or os.kill overflow.
FILE_NAME = re.compile(r"aiosync-(\d{1,20})-(\d{1,10})-([0-9a-f]{16})")
"""A segment file's name: its creator's PID namespace, pid and random token."""
_SHOWN = 80  # characters of a peer-chosen name that an error repeats


def shown_name(name: object) -> str:
    """A peer-chosen name as an error may repeat it: quoted, cut to 80 characters."""
    text = str(name)
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def open_directory(path: str | Path) -> int:
    """A descriptor of the directory ``path`` (never through a symbolic link), to open names in."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


# --------------------------------------------------------------------------------------
# the stale-segment sweep
# --------------------------------------------------------------------------------------


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink files whose creating process no longer exists; returns their names.

    Best effort, and never raises: only entries whose whole name is a segment's, made in
    this PID namespace by a pid that no longer exists, that are regular files (looked at
    without following symlinks) owned by this user, are removed. Anything else, and every
    error, is left alone.
    """
    removed: list[str] = []
    try:
        dirfd = open_directory(shm_dir)
    except OSError:
        return removed
    try:
        with os.scandir(dirfd) as entries:
            for entry in dead_entries(entries, FILE_NAME, stat.S_ISREG):
                try:
                    # unlink never follows a symlink; /dev/shm is sticky, so no other user
                    # can swap our file for theirs between the look and here.
                    os.unlink(entry.name, dir_fd=dirfd)
                except OSError:
                    continue
                removed.append(entry.name)
    except OSError:
        pass
    finally:
        os.close(dirfd)
    if removed:
        log.warning("removed %d shared-memory segments left by dead processes", len(removed))
    return removed


# --------------------------------------------------------------------------------------
# making segments
# --------------------------------------------------------------------------------------


def check_free(size: int, free: int | None, where: str) -> None:
    """Refuse a new segment of ``size`` bytes when ``where`` has only ``free`` (None: unknown)."""
    if free is not None and size > free:
        raise AiosyncError(
            f"cannot reserve {size} bytes of shared memory: {where} has {free} bytes free "
            "(see 'Shared memory' in docs/security.md for sizing it)"
        )


def reserve_segment(fd: int, size: int, where: str, free: int | None) -> None:
    """Size a new segment and take its memory now, so a lack of memory fails here.

    ``ftruncate`` alone leaves the file sparse: on a small ``/dev/shm`` (64 MiB in a
    default container) the first write past what is free would kill the process (SIGBUS).
    """
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise AiosyncError(
            f"cannot reserve {size} bytes of shared memory ({exc.strerror}); "
            f"{where} had {free if free is not None else 'an unknown number of'} bytes free"
        ) from None


class _ReadOnlyRegion:
    """A read-only mapping shown to numpy as plain memory, so torch takes it without a warning.

    ``torch.frombuffer`` and ``torch.from_numpy`` warn on a read-only buffer (torch has no
    read-only tensors). The pages themselves stay read-only: a write through the tensor is
    a SIGSEGV, never a change to the peer's memory. This object keeps the mapping exported,
    so it stays mapped while any view of the tensor lives.
    """

    def __init__(self, region: mmap.mmap, size: int) -> None:
        self._exported = numpy.frombuffer(region, dtype=numpy.uint8, count=size)
        self.__array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (self._exported.ctypes.data, False),
            "version": 3,
        }


def map_segment(fd: int, size: int, *, writable: bool = True) -> torch.Tensor:
    """Map ``size`` bytes of ``fd``, shared, as a flat ``uint8`` tensor.

    ``writable=False`` maps the pages ``PROT_READ`` only (``fd`` may then be opened
    read-only): what an engine does with a peer's segment. The tensor holds the only
    reference to the ``mmap`` object, which unmaps when the last view of the tensor goes.
    Never close that object: ``torch.frombuffer`` does not keep the buffer exported, so
    ``mmap.close()`` would unmap the pages under the tensor.
    """
    if not writable:
        region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return torch.from_numpy(numpy.asarray(_ReadOnlyRegion(region, size)))
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(region, dtype=torch.uint8)


def create_file_segment(size: int, stem: str) -> tuple[str, torch.Tensor]:
    """Make ``/dev/shm/aiosync-<stem>`` of ``size`` bytes, mapped; returns its name and view."""
    name = SHM_PREFIX + stem
    try:
        dirfd = open_directory(SHM_DIR)
    except OSError as exc:
        raise AiosyncError(f"cannot open {SHM_DIR} as a directory: {exc.strerror}") from None
    try:
        vfs = os.fstatvfs(dirfd)
        free = vfs.f_bavail * vfs.f_frsize
        check_free(size, free, str(SHM_DIR))
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, MODE, dir_fd=dirfd)
        try:
            os.fchmod(fd, MODE)  # whatever the umask
            reserve_segment(fd, size, str(SHM_DIR), free)
            tensor = map_segment(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dirfd)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(dirfd)
    return name, tensor


# --------------------------------------------------------------------------------------
# opening a peer's segment: every check on the descriptor
# --------------------------------------------------------------------------------------


def file_kind(mode: int) -> str:
    """What a descriptor that is not a regular file is, for an error (``"a directory"``)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def check_claimed_size(name: str, size: object, max_size: int | None) -> int:
    """The size a peer claims for segment ``name``: a positive integer, at most ``max_size``."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise AiosyncError(f"shared-memory segment {shown_name(name)} has no integer size")
    if size <= 0:
        raise AiosyncError(f"shared-memory segment {shown_name(name)} claims {size} bytes")
    if max_size is not None and size > max_size:
        raise AiosyncError(
            f"shared-memory segment {shown_name(name)} claims {size} bytes, over the limit of "
            f"{max_size}"
        )
    return size


def check_segment_descriptor(fd: int, name: str, size: int, *, links: int | None) -> os.stat_result:
    """Refuse anything but this user's regular file, mode 0600, of exactly ``size`` bytes."""
    info = os.fstat(fd)
    shown = shown_name(name)
    if not stat.S_ISREG(info.st_mode):
        raise AiosyncError(f"shared-memory segment {shown} is {file_kind(info.st_mode)}")
    uid = os.geteuid()
    if info.st_uid != uid:
        raise AiosyncError(
            f"shared-memory segment {shown} is owned by uid {info.st_uid}, not this user ({uid})"
        )
    if stat.S_IMODE(info.st_mode) != MODE:
        raise AiosyncError(
            f"shared-memory segment {shown} has mode {stat.S_IMODE(info.st_mode):o}, not 600"
        )
    if links is not None and info.st_nlink != links:
        if info.st_nlink == 0:
            raise AiosyncError(f"shared-memory segment {shown} was removed as it was opened")
        raise AiosyncError(f"shared-memory segment {shown} has {info.st_nlink} names, not 1")
    if info.st_size != size:
        raise AiosyncError(f"shared-memory segment {shown} holds {info.st_size} bytes, not {size}")
    return info


def check_allocated(info: os.stat_result, shown: str) -> None:
    """Refuse a sparse segment: its holes would be filled from the engine's memory.

    A peer that only sized its file claims bytes it never took; reading them would make
    the engine take them instead (a copy, or pages faulted into a mapping).
    """
    allocated = info.st_blocks * 512
    if allocated < info.st_size:
        raise AiosyncError(
            f"shared-memory segment {shown} claims {info.st_size} bytes but holds only "
            f"{allocated} (a sparse segment; its creator must reserve every byte)"
        )


def open_file_segment(name: str, size: int, *, writable: bool) -> int:
    """Open ``/dev/shm/<name>`` once, without following links or creating; checked."""
    shown = shown_name(name)
    try:
        dirfd = open_directory(SHM_DIR)
    except OSError as exc:
        raise AiosyncError(f"cannot open {SHM_DIR} as a directory: {exc.strerror}") from None
    try:
        access = os.O_RDWR if writable else os.O_RDONLY
        flags = access | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        fd = os.open(name, flags, dir_fd=dirfd)
    except FileNotFoundError:
        raise AiosyncError(f"shared-memory segment {shown} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            what = "is a symbolic link (segments are never followed)"
        elif exc.errno == errno.EISDIR:
            what = "is a directory"
        else:
            what = f"cannot be opened ({exc.strerror})"
        raise AiosyncError(f"shared-memory segment {shown} {what}") from None
    finally:
        os.close(dirfd)
    try:
        check_allocated(check_segment_descriptor(fd, name, size, links=1), shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


# --------------------------------------------------------------------------------------
# reading a peer's file without mapping it
# --------------------------------------------------------------------------------------


def check_used(name: str, size: int, used: object) -> int:
    """The bytes a bucket uses of segment ``name``: an integer from 0 to its ``size``."""
    if not isinstance(used, int) or isinstance(used, bool) or not 0 <= used <= size:
        raise AiosyncError(
            f"a bucket of {shown_name(used)} bytes does not fit shared-memory segment "
            f"{shown_name(name)} of {size}"
        )
    return used


class CopiedFileBuffer:
    """A file in ``/dev/shm``, never mapped: each bucket is read into this engine's memory.

    A file can shrink at any moment; ``preadv`` then comes back short, which is an error
    here, where a mapping would have killed the process.
    """

    def __init__(self, name: str, size: int, fd: int) -> None:
        self._name = name
        self._shown = shown_name(name)
        self._size = size
        self._fd: int | None = fd
        self._copy: torch.Tensor | None = None

    def view(self, used: int) -> torch.Tensor:
        """The first ``used`` bytes of the file, read now into this engine's buffer."""
        used = check_used(self._name, self._size, used)
        if self._fd is None:
            raise AiosyncError(f"shared-memory segment {self._shown} is closed")
        try:
            actual = os.fstat(self._fd)
        except OSError as exc:
            raise AiosyncError(
                f"shared-memory segment {self._shown} cannot be read ({exc.strerror})"
            ) from None
        if actual.st_size != self._size:
            raise AiosyncError(
                f"shared-memory segment {self._shown} now holds {actual.st_size} bytes, not "
                f"{self._size}: its creator resized it"
            )
        check_allocated(actual, self._shown)
        if self._copy is None:
            self._copy = torch.empty(self._size, dtype=torch.uint8)
        out = self._copy[:used]
        target = out.numpy().data  # a writable memoryview of these bytes
        done = 0
        while done < used:
            try:
                got = os.preadv(self._fd, [target[done:]], done)
            except OSError as exc:
                raise AiosyncError(
                    f"shared-memory segment {self._shown} cannot be read ({exc.strerror})"
                ) from None
            if got == 0:
                raise AiosyncError(
                    f"shared-memory segment {self._shown} shrank below {used} bytes while "
                    "a bucket was read from it"
                )
            done += got
        return out

    def close(self) -> None:
        """Close the descriptor and drop the buffer; a later :meth:`view` raises."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._copy = None
