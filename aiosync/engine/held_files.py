"""A resume directory opened once: bucket files by digest, each operation relative to it.

:class:`BucketDir` makes the directory (mode 0700) if it is missing, opens it with
``O_DIRECTORY | O_NOFOLLOW`` and checks the descriptor (``fstat``: a directory of this
user that nobody else can write). It keeps that descriptor until :meth:`BucketDir.close`,
and every later operation names a file relative to it (``openat`` with ``O_NOFOLLOW``,
``unlinkat``, ``renameat``, ``fstatat`` without following links, listing the descriptor).
So a directory swapped for a symlink after the check, or moved away, changes nothing:
files go into the directory that was checked, or nowhere.

A bucket is a regular file of this user named by its digest's 64 hex digits, mode 0600,
written to ``<digest>.part`` (``O_CREAT | O_EXCL | O_NOFOLLOW``) and renamed. Anything
else under one of those names (a directory, a FIFO, a symlink, a device, another user's
file) is never used, never followed and never fatal: it is skipped and reported (logged
at WARNING, once per name, and kept in :attr:`BucketDir.skipped`); a non-directory is
removed (unlinking a symlink removes the link, never what it points at), a directory is
left where it is. Names that are not a bucket's are never touched. Not thread-safe: its
owner (:class:`~aiosync.engine.held.HeldBuckets`) serialises the calls.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import weakref
from pathlib import Path

import torch

from aiosync.core.errors import AiosyncError

log = logging.getLogger(__name__)

_SAVED = re.compile(r"[0-9a-f]{64}")
_PART = re.compile(r"[0-9a-f]{64}\.part")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _kind(info: os.stat_result) -> str:
    """What an entry that is not one of our bucket files is, for a report."""
    mode = info.st_mode
    if stat.S_ISREG(mode):
        return f"a file of uid {info.st_uid}, not this user's"
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a device"


def _open_private(path: Path) -> int:
    """``path`` made (0700) if missing, opened without following a link, checked; its fd."""
    need = f"resume directory {path} must be a directory of this user, 0700"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a dangling symlink or a file: the open below says which
    except OSError as exc:
        raise AiosyncError(f"cannot make resume directory {path}: {exc.strerror}") from None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        what = "a symlink or not a directory" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else ""
        raise AiosyncError(f"{need} (it is {what or exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise AiosyncError(f"{need} (owner uid {info.st_uid}, mode {info.st_mode & 0o777:o})")
    except BaseException:
        os.close(fd)
        raise
    return fd


class BucketDir:
    """A checked resume directory, held open by descriptor until :meth:`close`.

    ``path`` is made (0700) or must be a directory of this user that others cannot
    write, and not a symlink; otherwise :class:`AiosyncError` names it. :attr:`skipped`
    maps each entry under a bucket's name that was not a bucket file to what it was.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.skipped: dict[str, str] = {}
        self._fd: int | None = _open_private(path)
        self._closer = weakref.finalize(self, os.close, self._fd)

    @property
    def closed(self) -> bool:
        """Whether the directory's descriptor is closed (nothing more is read or written)."""
        return self._fd is None

    def close(self) -> None:
        """Close the directory's descriptor (the files stay, for the next process); idempotent."""
        self._fd = None
        self._closer()

    def _dir(self) -> int:
        if self._fd is None:
            raise AiosyncError(f"resume directory {self.path} is closed")
        return self._fd

    # --- buckets ----------------------------------------------------------------------

    def write(self, digest: bytes, data: torch.Tensor) -> bool:
        """Save ``data`` as the file of ``digest``, atomically; False (logged) if not saved."""
        fd, name = self._dir(), digest.hex()
        part = name + ".part"
        try:
            if not self._free(name, remove=False):
                return False  # a directory there: the rename could never replace it
            out = self._create(part)
            if out is None:
                return False
            with os.fdopen(out, "wb") as file:
                file.write(data.numpy().data)
            os.rename(part, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            log.warning("could not keep bucket %s in %s: %s", name[:16], self.path, exc)
            self._unlink(part)
            return False
        return True

    def read(self, digest: bytes, used: int) -> torch.Tensor | None:
        """A saved bucket's bytes (a regular file of this user, exactly ``used``), unchecked."""
        fd, name = self._dir(), digest.hex()
        try:
            if not self._is_bucket(name, os.stat(name, dir_fd=fd, follow_symlinks=False)):
                return None  # never opened: a FIFO, a device, another user's file
            with os.fdopen(os.open(name, _READ_FLAGS, dir_fd=fd), "rb") as saved:
                info = os.fstat(saved.fileno())
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                    self._report(name, _kind(info))
                    return None
                if info.st_size != used:
                    return None
                data = torch.empty(used, dtype=torch.uint8)
                if saved.readinto(data.numpy().data) != used:
                    return None
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._report(name, "a symbolic link")
            else:
                log.warning("could not read bucket %s in %s: %s", name[:16], self.path, exc)
            return None
        return data

    def remove(self, digest: bytes) -> None:
        """Remove the file of ``digest`` if it is there (a directory there is reported)."""
        self._free(digest.hex(), remove=True)

    def scan(self, max_bytes: int | None) -> list[tuple[bytes, int]]:
        """(digest, bytes) of the bucket files an earlier process saved, up to ``max_bytes``.

        Partial files and wrong entries go (see the module docstring), and so do files
        past ``max_bytes``; nothing is read.
        """
        found: list[tuple[bytes, int]] = []
        total = 0
        for name, info in self._ours():
            if not self._is_bucket(name, info) or _PART.fullmatch(name):
                self._unlink(name)
                continue
            if max_bytes is not None and total + info.st_size > max_bytes:
                self._unlink(name)
                continue
            total += info.st_size
            found.append((bytes.fromhex(name), info.st_size))
        return found

    def empty(self) -> None:
        """Remove every bucket and partial file (a directory under such a name is reported)."""
        for name, info in self._ours():
            self._is_bucket(name, info)
            self._unlink(name)

    # --- entries ----------------------------------------------------------------------

    def _ours(self) -> list[tuple[str, os.stat_result]]:
        """Each entry under a bucket's or a partial file's name, looked at without following.

        A directory is reported and left out: nothing is ever done to it.
        """
        fd = self._dir()
        entries: list[tuple[str, os.stat_result]] = []
        try:
            names = sorted(os.listdir(fd))
        except OSError as exc:
            log.warning("could not list resume directory %s: %s", self.path, exc)
            return entries
        for name in names:
            if not (_SAVED.fullmatch(name) or _PART.fullmatch(name)):
                continue  # not ours: never read, never removed
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                self._report(name, "a directory")
            else:
                entries.append((name, info))
        return entries

    def _is_bucket(self, name: str, info: os.stat_result) -> bool:
        """Whether ``info`` is a regular file of this user; reported when it is not."""
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            return True
        self._report(name, _kind(info))
        return False

    def _free(self, name: str, *, remove: bool) -> bool:
        """Make ``name`` free to be renamed onto, or (``remove``) gone; a wrong entry reported.

        False when a directory stands there: it is left where it is.
        """
        try:
            info = os.stat(name, dir_fd=self._dir(), follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.warning("could not look at %s in %s: %s", name, self.path, exc)
            return False
        if stat.S_ISDIR(info.st_mode):
            self._report(name, "a directory")
            return False
        self._is_bucket(name, info)
        if remove:
            self._unlink(name)
        return True

    def _create(self, part: str) -> int | None:
        """A new partial file ``part``, after removing a stale one; None where it cannot be."""
        for _ in range(2):
            try:
                return os.open(part, _NEW_FLAGS, 0o600, dir_fd=self._dir())
            except FileExistsError:
                if not self._free(part, remove=True):
                    return None
        return None

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir())
        except FileNotFoundError:
            pass
        except OSError as exc:  # a directory swapped in meanwhile, or no permission
            log.warning("could not remove %s in %s: %s", name, self.path, exc)

    def _report(self, name: str, kind: str) -> None:
        if name not in self.skipped:
            log.warning(
                "resume directory %s: %s is %s, not a bucket file; skipped", self.path, name, kind
            )
        self.skipped[name] = kind
