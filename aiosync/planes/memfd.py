"""Shared-memory segments as sealed memfds, and their opening from ``/proc/<pid>/fd/<n>``.

Sealed memfds are what a trainer's data plane makes by default. The creator
(:func:`create_memfd`) makes an anonymous ``memfd_create`` file, mode 0600, takes its
memory now (``posix_fallocate``, after checking :func:`memory_free`) and seals it with
``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: from then on nobody, the creator included,
can change its size. Asked to (``seal_writes``: a trainer's plane and the weight server do),
it first maps it and adds ``F_SEAL_FUTURE_WRITE`` (Linux >= 5.1): from then on only that
mapping can change its bytes (a kernel that refuses the seal is warned about, once). It
keeps the descriptor open; the handle's name says where an engine finds it,
``aiosync-memfd-<pidns>-<pid>-<fd>-<token>``, that is ``/proc/<pid>/fd/<fd>``.

The engine (:func:`open_memfd_segment`) refuses the name unless ``pidns`` is its own PID
namespace, opens that path with ``O_PATH`` (which has no effect on whatever file it is: no
device is opened, no FIFO waited on), and checks the descriptor: a regular file owned by
this user, mode 0600, exactly the claimed size (within the caller's limit), the very memfd
the creator named (``/memfd:aiosync-<pidns>-<pid>-<token>``, so a descriptor number reused
for another file is refused), on the filesystem of this process's own memfds (not
hugetlbfs, whose holes can fault), and sealed as above (``F_GET_SEALS``). It then reopens
that checked descriptor (``/proc/self/fd``, our own descriptor, which nobody else can
change) read-only, checks it again, and the caller maps it ``PROT_READ`` with :mod:`mmap`;
nothing is opened by name again. A sealed segment cannot shrink, so a mapped bucket can
never fault, and the engine cannot write into the creator's memory (a write through its
view is a SIGSEGV). Zero copies. Only :meth:`~aiosync.planes.shm.ShmSegment.attach` with
``writable=True`` reopens it read-write.

Memfds need no name in ``/dev/shm``: a killed trainer leaves nothing behind and the size of
``/dev/shm`` does not matter (the memory counts against the machine's and the container's
memory instead, which :func:`memory_free` measures). Both processes must be the same user
in one PID namespace. The checks shared with files in ``/dev/shm`` are in
:mod:`aiosync.planes.shm_files`.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import re
import stat
from pathlib import Path

import torch

from aiosync.core.errors import AiosyncError
from aiosync.planes.shm_files import (
    MODE,
    SHM_PREFIX,
    check_allocated,
    check_free,
    check_segment_descriptor,
    file_kind,
    map_segment,
    open_directory,
    reserve_segment,
    shown_name,
)
from aiosync.private_dirs import pid_namespace

log = logging.getLogger(__name__)

MEMFD_PREFIX = "aiosync-memfd-"
BACKEND_ENV = "AIOSYNC_SHM_BACKEND"
"""Environment variable choosing how a trainer's data plane makes segments: memfd or file."""

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_F_SEAL_FUTURE_WRITE = 0x0010  # not exported by Python 3.11's fcntl
_WRITE_SEALS = fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE
# Bounded digit counts (as in FILE_NAME): a planted name can't make int() slow.
MEMFD_NAME = re.compile(r"aiosync-memfd-(\d{1,20})-([1-9]\d{0,9})-(0|[1-9]\d{0,9})-([0-9a-f]{16})")
"""A sealed memfd's name: its creator's PID namespace, pid, descriptor number and token."""


# --------------------------------------------------------------------------------------
# making memfds
# --------------------------------------------------------------------------------------


@functools.cache
def _memfd_device() -> int | None:
    """``st_dev`` of this process's sealed memfds; ``None`` if it cannot make them."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("aiosync-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return os.fstat(fd).st_dev
    except OSError:
        return None
    finally:
        os.close(fd)


def memfd_available() -> bool:
    """Whether segments can be sealed memfds here (and their pids mean something)."""
    return _memfd_device() is not None and pid_namespace() != 0


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup can still take (limit - usage + inactive files)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            base, names = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        # inside a container the hierarchy is usually mounted at the container's own cgroup
        for directory in (base / path.lstrip("/"), base):
            try:
                limit = (directory / names[0]).read_text().strip()
                usage = int((directory / names[1]).read_text())
                if limit == "max":
                    break
                inactive = 0
                for stat_line in (directory / "memory.stat").read_text().splitlines():
                    key, _, value = stat_line.partition(" ")
                    if key == names[2]:
                        inactive = int(value)
                found.append(max(0, int(limit) - usage + inactive))
                break
            except (OSError, ValueError):
                continue
    return min(found) if found else None


def memory_free() -> int | None:
    """Bytes a new memfd can take: available memory, or the cgroup's headroom if less."""
    known = [n for n in (_meminfo_available(), _cgroup_headroom()) if n is not None]
    return min(known) if known else None


def create_memfd(
    size: int, stem: str, *, seal_writes: bool = False
) -> tuple[str, int, torch.Tensor]:
    """Make a sealed memfd of ``size`` bytes, mapped; returns its name, descriptor and view.

    ``seal_writes``: also seal it with ``F_SEAL_FUTURE_WRITE`` (Linux >= 5.1; where the
    kernel refuses it, skipped with a warning) once it is mapped, so the returned view is
    the only way left to change its bytes: no other descriptor or process can ``write``,
    punch holes or map it writable. The caller keeps the descriptor open: the name points at it.
    """
    free = memory_free()
    check_free(size, free, "memory")
    fd = os.memfd_create(SHM_PREFIX + stem, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, MODE)
        reserve_segment(fd, size, "memory", free)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        tensor = map_segment(fd, size)  # before the write seal, which refuses new writable maps
        if seal_writes and not _seal_future_writes(fd):
            _warn_unsealed()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    namespace, pid, token = stem.split("-")
    name = f"{MEMFD_PREFIX}{namespace}-{pid}-{fd}-{token}"
    return name, fd, tensor


def _seal_future_writes(fd: int) -> bool:
    """Add ``F_SEAL_FUTURE_WRITE``; False where this kernel does not know it (before 5.1)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


@functools.cache
def _warn_unsealed() -> None:
    log.warning(
        "this kernel refuses F_SEAL_FUTURE_WRITE (Linux before 5.1): any process of this "
        "user can open a memfd segment through /proc/<pid>/fd and change its bytes "
        "(docs/security.md, shared memory)"
    )


# --------------------------------------------------------------------------------------
# opening a peer's segment: every check on the descriptor
# --------------------------------------------------------------------------------------


def open_memfd_segment(name: str, size: int, match: re.Match[str], *, writable: bool) -> int:
    """Open the sealed memfd ``/proc/<pid>/fd/<fd>`` that ``name`` points at; checked.

    ``writable=False`` (what an engine asks for) opens it read-only, so it can only be
    mapped ``PROT_READ``; a segment sealed against writes is then accepted.
    """
    shown = shown_name(name)
    namespace, pid, number, token = (match.group(i) for i in range(1, 5))
    ours = pid_namespace()
    if int(namespace) != ours or ours == 0:
        raise AiosyncError(
            f"shared-memory segment {shown} was made in another PID namespace ({namespace}, "
            f"this process is in {ours}); memfd segments need the creator and the engine in "
            f"one PID namespace (or make file segments: {BACKEND_ENV}=file)"
        )
    device = _memfd_device()
    if device is None:
        raise AiosyncError(f"cannot check memfd segment {shown}: this process has no memfds")
    try:
        dirfd = open_directory(f"/proc/{pid}/fd")
    except FileNotFoundError:
        raise AiosyncError(
            f"shared-memory segment {shown} does not exist (its creator, pid {pid}, is gone)"
        ) from None
    except OSError as exc:
        raise AiosyncError(
            f"shared-memory segment {shown}: cannot reach pid {pid}'s descriptors "
            f"({exc.strerror}; another user's process?)"
        ) from None
    try:
        # O_PATH follows the /proc link without opening the file for I/O: whatever the
        # peer points at (a device, a FIFO, a socket), nothing happens to it.
        path_fd = os.open(number, os.O_PATH | os.O_CLOEXEC, dir_fd=dirfd)
    except FileNotFoundError:
        raise AiosyncError(
            f"shared-memory segment {shown} does not exist (pid {pid} has no descriptor {number})"
        ) from None
    except OSError as exc:
        raise AiosyncError(
            f"shared-memory segment {shown} cannot be reached ({exc.strerror})"
        ) from None
    finally:
        os.close(dirfd)
    try:
        # Is it the memfd the creator named? A descriptor number closed and reused for
        # another file (or one the peer picked at random) is not.
        found = os.fstat(path_fd)
        gone = f"shared-memory segment {shown} does not exist: descriptor {number} of pid {pid}"
        if not stat.S_ISREG(found.st_mode):
            raise AiosyncError(f"{gone} is {file_kind(found.st_mode)}")
        expected = f"/memfd:{SHM_PREFIX}{namespace}-{pid}-{token} (deleted)"
        if os.readlink(f"/proc/self/fd/{path_fd}") != expected:
            raise AiosyncError(f"{gone} is another file")
        first = check_segment_descriptor(path_fd, name, size, links=None)
        access = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(
            f"/proc/self/fd/{path_fd}", access | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        )
    except OSError as exc:
        raise AiosyncError(
            f"shared-memory segment {shown} cannot be opened ({exc.strerror})"
        ) from None
    finally:
        os.close(path_fd)
    try:
        info = check_segment_descriptor(fd, name, size, links=None)
        if (info.st_dev, info.st_ino) != (first.st_dev, first.st_ino):
            raise AiosyncError(f"shared-memory segment {shown} changed while it was opened")
        if info.st_dev != device:
            raise AiosyncError(
                f"shared-memory segment {shown} is not an ordinary memfd (another filesystem, "
                "such as hugetlbfs)"
            )
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _SEALS != _SEALS:
            raise AiosyncError(
                f"shared-memory segment {shown} is not sealed against shrinking and growing"
            )
        if writable and seals & _WRITE_SEALS:
            raise AiosyncError(f"shared-memory segment {shown} is sealed against writing")
        check_allocated(info, shown)
    except OSError as exc:
        os.close(fd)
        raise AiosyncError(
            f"shared-memory segment {shown} cannot be checked ({exc.strerror})"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd
