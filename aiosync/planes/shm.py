"""The shared-memory data plane: segments of this host's memory mapped as ``uint8`` tensors.

A segment is a flat ``uint8`` tensor plus a plain-data handle (``ShmHandle``: a name and a
size) from which another process on this machine reaches the same memory. No sockets here.

An engine must not trust the handle: the peer that sent it may name a file it planted, swap
a name between a check and a map, or shrink the file under the engine's mapping (a read of
a mapped page past the end of a file kills the process with SIGBUS; no Python error).
ZMQ cannot pass descriptors, so the design is:

Sealed memfds (what a trainer's data plane makes by default)
    The creator makes an anonymous ``memfd_create`` file, mode 0600, takes its memory now
    (``posix_fallocate``) and seals it with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``:
    from then on nobody, the creator included, can change its size. It keeps the descriptor
    open; the handle's name says where an engine finds it,
    ``aiosync-memfd-<pidns>-<pid>-<fd>-<token>``, that is ``/proc/<pid>/fd/<fd>``. The
    engine refuses the name unless ``pidns`` is its own PID namespace, opens that path with
    ``O_PATH`` (which has no effect on whatever file it is: no device is opened, no FIFO
    waited on), and checks the descriptor: a regular file owned by this user, mode 0600,
    exactly the claimed size (within the caller's limit), the very memfd the creator named
    (``/memfd:aiosync-<pidns>-<pid>-<token>``, so a descriptor number reused for another
    file is refused), on the filesystem of this process's own memfds (not hugetlbfs, whose
    holes can fault), and sealed as above (``F_GET_SEALS``). It then reopens that checked
    descriptor read-write (``/proc/self/fd``, our own descriptor, which nobody else can
    change), checks it again, and maps it with :mod:`mmap`; nothing is opened by name
    again. A sealed segment cannot shrink, so a mapped bucket can never fault. Zero copies.
    Memfds need no name in ``/dev/shm``: a killed trainer leaves nothing behind and the
    size of ``/dev/shm`` does not matter (the memory counts against the machine's and the
    container's memory instead). Both processes must be the same user in one PID namespace.

Files in ``/dev/shm`` (the fallback)
    ``aiosync-<pidns>-<pid>-<token>``, made with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode
    0600, reserved with ``posix_fallocate`` after a ``statvfs`` check. A data plane makes
    these where memfds cannot be made and sealed, or when ``AIOSYNC_SHM_BACKEND=file`` asks
    for them (an engine in another PID namespace that shares this ``/dev/shm``); they are
    also :meth:`ShmSegment.create`'s default. A file cannot be sealed, so an
    engine never maps one: :class:`ShmReceiverPlane` opens the name once, relative to a
    descriptor of ``/dev/shm``, with ``O_NOFOLLOW`` and without ``O_CREAT``, checks the
    descriptor (regular file, this user's, mode 0600, one link, the claimed size) and reads
    each bucket with ``preadv`` from that descriptor into its own buffer, after checking
    the size again: a file shrunk at any moment makes a short read and an
    :class:`AiosyncError`, never a SIGBUS. The price is one copy per bucket on the engine
    (about the cost of a memcpy) and the engine's own buffer per segment.
    :meth:`ShmSegment.attach` does map such a file (the teacher buffers of
    :mod:`aiosync.compat.teacher` share writes both ways): its creator must be trusted not
    to shrink it.

The sender unlinks its files when it closes; :func:`sweep_stale_segments` removes those
left by killed processes of this PID namespace (a pid from another namespace, say another
container sharing ``/dev/shm``, says nothing here) whenever a segment is made or an
engine's plane closes. docs/security.md ("Shared memory") says the same for operators.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Literal

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, pack_bucket
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.private_dirs import pid_alive, pid_namespace

log = logging.getLogger(__name__)

Backend = Literal["memfd", "file"]

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "aiosync-"
MEMFD_PREFIX = "aiosync-memfd-"
BACKEND_ENV = "AIOSYNC_SHM_BACKEND"
"""Environment variable choosing how a trainer's data plane makes segments: memfd or file."""

MODE = 0o600
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_F_SEAL_FUTURE_WRITE = 0x0010  # not exported by Python 3.11's fcntl
_WRITE_SEALS = fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE
# Bounded digit counts: a planted name can't make int() slow or os.kill overflow.
_FILE_NAME = re.compile(r"aiosync-(\d{1,20})-(\d{1,10})-([0-9a-f]{16})")
_MEMFD_NAME = re.compile(r"aiosync-memfd-(\d{1,20})-([1-9]\d{0,9})-(0|[1-9]\d{0,9})-([0-9a-f]{16})")
_SHOWN = 80  # characters of a peer-chosen name that an error repeats


def _shown(name: object) -> str:
    text = str(name)
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _open_directory(path: str | Path) -> int:
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
    namespace = pid_namespace()
    if namespace == 0:  # without /proc no pid can be judged dead
        return removed
    uid = os.geteuid()
    try:
        dirfd = _open_directory(shm_dir)
    except OSError:
        return removed
    try:
        with os.scandir(dirfd) as entries:
            for entry in entries:
                match = _FILE_NAME.fullmatch(entry.name)
                if not match or int(match.group(1)) != namespace:
                    continue
                if pid_alive(int(match.group(2))):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
                        continue
                    # unlink never follows a symlink; /dev/shm is sticky, so no other user
                    # can swap our file for theirs between the lstat and here.
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


def _backend(requested: Backend | None) -> Backend:
    wanted = requested or os.environ.get(BACKEND_ENV, "").strip().lower() or None
    if wanted not in (None, "memfd", "file"):
        raise AiosyncError(f"{BACKEND_ENV} is {_shown(wanted)}; use memfd or file")
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


def _check_free(size: int, free: int | None, where: str) -> None:
    if free is not None and size > free:
        raise AiosyncError(
            f"cannot reserve {size} bytes of shared memory: {where} has {free} bytes free "
            "(see 'Shared memory' in docs/security.md for sizing it)"
        )


def _reserve(fd: int, size: int, where: str, free: int | None) -> None:
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


def _map(fd: int, size: int) -> torch.Tensor:
    """Map ``size`` bytes of ``fd``, shared and read-write, as a flat ``uint8`` tensor.

    The tensor holds the only reference to the ``mmap`` object, which unmaps when the last
    view of the tensor goes. Never close that object: ``torch.frombuffer`` does not keep
    the buffer exported, so ``mmap.close()`` would unmap the pages under the tensor.
    """
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(region, dtype=torch.uint8)


# --------------------------------------------------------------------------------------
# opening a peer's segment: every check on the descriptor
# --------------------------------------------------------------------------------------


def _kind(mode: int) -> str:
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


def _check_size(name: str, size: object, max_size: int | None) -> int:
    if not isinstance(size, int) or isinstance(size, bool):
        raise AiosyncError(f"shared-memory segment {_shown(name)} has no integer size")
    if size <= 0:
        raise AiosyncError(f"shared-memory segment {_shown(name)} claims {size} bytes")
    if max_size is not None and size > max_size:
        raise AiosyncError(
            f"shared-memory segment {_shown(name)} claims {size} bytes, over the limit of "
            f"{max_size}"
        )
    return size


def _check_descriptor(fd: int, name: str, size: int, *, links: int | None) -> os.stat_result:
    """Refuse anything but this user's regular file, mode 0600, of exactly ``size`` bytes."""
    info = os.fstat(fd)
    shown = _shown(name)
    if not stat.S_ISREG(info.st_mode):
        raise AiosyncError(f"shared-memory segment {shown} is {_kind(info.st_mode)}")
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


def _open_file_segment(name: str, size: int, *, writable: bool) -> int:
    """Open ``/dev/shm/<name>`` once, without following links or creating; checked."""
    shown = _shown(name)
    try:
        dirfd = _open_directory(SHM_DIR)
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
        _check_descriptor(fd, name, size, links=1)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_memfd_segment(name: str, size: int, match: re.Match[str]) -> int:
    """Open the sealed memfd ``/proc/<pid>/fd/<fd>`` that ``name`` points at; checked."""
    shown = _shown(name)
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
        dirfd = _open_directory(f"/proc/{pid}/fd")
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
            raise AiosyncError(f"{gone} is {_kind(found.st_mode)}")
        expected = f"/memfd:{SHM_PREFIX}{namespace}-{pid}-{token} (deleted)"
        if os.readlink(f"/proc/self/fd/{path_fd}") != expected:
            raise AiosyncError(f"{gone} is another file")
        first = _check_descriptor(path_fd, name, size, links=None)
        fd = os.open(
            f"/proc/self/fd/{path_fd}", os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        )
    except OSError as exc:
        raise AiosyncError(
            f"shared-memory segment {shown} cannot be opened ({exc.strerror})"
        ) from None
    finally:
        os.close(path_fd)
    try:
        info = _check_descriptor(fd, name, size, links=None)
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
        if seals & _WRITE_SEALS:
            raise AiosyncError(f"shared-memory segment {shown} is sealed against writing")
    except OSError as exc:
        os.close(fd)
        raise AiosyncError(
            f"shared-memory segment {shown} cannot be checked ({exc.strerror})"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_segment(
    handle: ShmHandle, *, max_size: int | None, writable: bool = True
) -> tuple[int, Backend]:
    """Open a peer's segment once and check it on the descriptor; returns it and its kind.

    Raises :class:`AiosyncError` naming the segment and what is wrong with it. The caller
    owns the descriptor.
    """
    name = handle.name
    if not isinstance(name, str):
        raise AiosyncError(f"refusing shared-memory name {_shown(name)}")
    if match := _MEMFD_NAME.fullmatch(name):
        size = _check_size(name, handle.size, max_size)
        return _open_memfd_segment(name, size, match), "memfd"
    if _FILE_NAME.fullmatch(name):
        size = _check_size(name, handle.size, max_size)
        return _open_file_segment(name, size, writable=writable), "file"
    raise AiosyncError(f"refusing shared-memory name {_shown(name)}")


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
    def create(cls, size: int, *, backend: Backend = "file") -> ShmSegment:
        """Make a segment of ``size`` bytes, readable and writable by this user only.

        ``backend``: ``"file"``, a name in ``/dev/shm`` (the default, which any process of
        this user sharing that directory can open, as :mod:`aiosync.compat.teacher` needs),
        or ``"memfd"``, sealed against resizing (what a trainer's data plane makes where it
        can: see :class:`ShmSenderPlane`). The memory is taken now: too little of it is an
        :class:`AiosyncError` saying how much was needed and how much is free, before
        anything is made.
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
            return cls._create_memfd(size, stem)
        return cls._create_file(size, stem)

    @classmethod
    def _create_memfd(cls, size: int, stem: str) -> ShmSegment:
        free = memory_free()
        _check_free(size, free, "memory")
        fd = os.memfd_create(SHM_PREFIX + stem, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, MODE)
            _reserve(fd, size, "memory", free)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            tensor = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        namespace, pid, token = stem.split("-")
        name = f"{MEMFD_PREFIX}{namespace}-{pid}-{fd}-{token}"
        return cls(name, size, tensor, owner=True, backend="memfd", fd=fd)

    @classmethod
    def _create_file(cls, size: int, stem: str) -> ShmSegment:
        name = SHM_PREFIX + stem
        try:
            dirfd = _open_directory(SHM_DIR)
        except OSError as exc:
            raise AiosyncError(f"cannot open {SHM_DIR} as a directory: {exc.strerror}") from None
        try:
            vfs = os.fstatvfs(dirfd)
            free = vfs.f_bavail * vfs.f_frsize
            _check_free(size, free, str(SHM_DIR))
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, MODE, dir_fd=dirfd)
            try:
                os.fchmod(fd, MODE)  # whatever the umask
                _reserve(fd, size, str(SHM_DIR), free)
                tensor = _map(fd, size)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dirfd)
                raise
            finally:
                os.close(fd)
        finally:
            os.close(dirfd)
        return cls(name, size, tensor, owner=True, backend="file")

    @classmethod
    def attach(cls, handle: ShmHandle, *, max_size: int | None = None) -> ShmSegment:
        """Map a segment another process made, after checking it (see the module docstring).

        ``max_size``: the most bytes the caller accepts (the claimed size must also be the
        segment's real size, so without it nothing bigger than what exists is mapped).

        A memfd segment is sealed and cannot fault. A file segment is mapped too, and its
        creator could shrink it under the mapping: use this only for segments of a trusted
        creator. :class:`ShmReceiverPlane`, which trusts no peer, never maps a file.
        """
        fd, kind = open_segment(handle, max_size=max_size)
        try:
            tensor = _map(fd, handle.size)
        except (OSError, ValueError) as exc:
            raise AiosyncError(
                f"cannot map shared-memory segment {_shown(handle.name)}: {exc}"
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


class ShmSenderPlane:
    """A ring of shared-memory segments the trainer packs into; engines open them by name.

    ``backend``: by default :data:`BACKEND_ENV` (``memfd`` or ``file``) if set, else sealed
    memfds where they can be made, else files (with a warning: engines then copy each
    bucket out). The segments stay open while the plane is, so engines may join at any
    time between versions; :meth:`close` closes them. Memfds go with the trainer's
    process; files of a trainer killed before it could unlink them are removed by the next
    plane made or closed on this machine (:func:`sweep_stale_segments`).
    """

    def __init__(self, count: int, capacity: int, *, backend: Backend | None = None) -> None:
        kind = _backend(backend)
        self._segments: list[ShmSegment] = []
        try:
            for _ in range(count):
                self._segments.append(ShmSegment.create(capacity, backend=kind))
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


def _check_used(name: str, size: int, used: object) -> int:
    if not isinstance(used, int) or isinstance(used, bool) or not 0 <= used <= size:
        raise AiosyncError(
            f"a bucket of {_shown(used)} bytes does not fit shared-memory segment "
            f"{_shown(name)} of {size}"
        )
    return used


class _MappedBuffer:
    """A sealed memfd, mapped: a bucket is a view of its first bytes (zero copies)."""

    def __init__(self, segment: ShmSegment) -> None:
        self._segment = segment

    def view(self, used: int) -> torch.Tensor:
        segment = self._segment
        return segment.tensor[: _check_used(segment.name, segment.size, used)]

    def close(self) -> None:
        self._segment.close()


class _CopiedBuffer:
    """A file in ``/dev/shm``, never mapped: each bucket is read into this engine's memory.

    A file can shrink at any moment; ``preadv`` then comes back short, which is an error
    here, where a mapping would have killed the process.
    """

    def __init__(self, name: str, size: int, fd: int) -> None:
        self._name = name
        self._shown = _shown(name)
        self._size = size
        self._fd: int | None = fd
        self._copy: torch.Tensor | None = None

    def view(self, used: int) -> torch.Tensor:
        used = _check_used(self._name, self._size, used)
        if self._fd is None:
            raise AiosyncError(f"shared-memory segment {self._shown} is closed")
        try:
            actual = os.fstat(self._fd).st_size
        except OSError as exc:
            raise AiosyncError(
                f"shared-memory segment {self._shown} cannot be read ({exc.strerror})"
            ) from None
        if actual != self._size:
            raise AiosyncError(
                f"shared-memory segment {self._shown} now holds {actual} bytes, not "
                f"{self._size}: its creator resized it"
            )
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
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._copy = None


class ShmReceiverPlane:
    """An engine's hold on a sender's segments, opened as the module docstring describes.

    ``max_buffers`` and ``max_bytes`` bound what one peer's plane may name (an engine passes
    its limits; ``None``: no bound here beyond the segments' real sizes). Anything refused
    is an :class:`AiosyncError` and leaves nothing open.
    """

    def __init__(
        self,
        spec: ShmPlaneSpec,
        *,
        max_buffers: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self._buffers: list[_MappedBuffer | _CopiedBuffer] = []
        handles = spec.buffers
        if max_buffers is not None and len(handles) > max_buffers:
            raise AiosyncError(
                f"a shared-memory plane of {len(handles)} segments is over the limit of "
                f"{max_buffers}"
            )
        for handle in handles:
            _check_size(handle.name, handle.size, max_bytes)
        total = sum(handle.size for handle in handles)
        if max_bytes is not None and total > max_bytes:
            raise AiosyncError(
                f"a shared-memory plane of {total} bytes is over the limit of {max_bytes}"
            )
        try:
            for handle in handles:
                if isinstance(handle.name, str) and _MEMFD_NAME.fullmatch(handle.name):
                    segment = ShmSegment.attach(handle, max_size=max_bytes)
                    self._buffers.append(_MappedBuffer(segment))
                else:
                    fd, _ = open_segment(handle, max_size=max_bytes, writable=False)
                    self._buffers.append(_CopiedBuffer(handle.name, handle.size, fd))
        except BaseException:
            self.close()
            raise

    def view(self, index: int, used: int) -> torch.Tensor:
        """The first ``used`` bytes of segment ``index`` (checked against its size)."""
        if not isinstance(index, int) or not 0 <= index < len(self._buffers):
            raise AiosyncError(f"no shared-memory segment {_shown(index)} in this plane")
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
