"""A group's rendezvous on one host: a torch ``FileStore`` in a private directory.

Any local user who finds a ``TCPStore``'s port can list its keys, join its group and store
what it likes in the hosting process. A file in a directory only this user can enter
(mode 0700) leaves other users out altogether. The trainer makes the directory
(``aiosync-store-<pidns>-<pid>-<random>`` under the temporary directory, see
:mod:`aiosync.private_dirs`) and the file in it, ``rendezvous`` (mode 0600, made with
``O_EXCL | O_NOFOLLOW``), and removes both when its plane closes; one left by a killed
process is swept by the next one made.

The path reaches the engine inside the hello and is hostile input: :func:`check_store_path`
(pure) wants an absolute, normalised path naming that file in a directory of that form, and
:func:`open_file_store` then checks on disk, without following links, that no component is
a symlink, that the directory is this user's and closed to others, and that the file is a
regular file of this user's, closed to others, with one link, before torch opens it.
"""

from __future__ import annotations

import os
import shutil
import stat
from datetime import timedelta
from pathlib import Path

from torch._C._distributed_c10d import FileStore

from aiosync.core.errors import ProtocolError
from aiosync.private_dirs import creator_pid, make_private_dir

STORE_PREFIX = "aiosync-store-"
STORE_FILE = "rendezvous"
MAX_PATH = 4096


class FileRendezvous:
    """The trainer's private directory and rendezvous file (``path``) for one group."""

    def __init__(self) -> None:
        directory = Path(os.path.realpath(make_private_dir(prefix=STORE_PREFIX)))
        self.directory = directory
        self.path = str(directory / STORE_FILE)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(self.path, flags, 0o600))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def store(self, timeout: timedelta) -> FileStore:
        """A store on the file (each call a new one; none holds a descriptor)."""
        return _file_store(self.path, timeout)

    def close(self) -> None:
        """Remove the directory and the file (idempotent; never follows a symlink)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def check_store_path(path: str) -> str | None:
    """What is wrong with a peer's rendezvous path, or ``None`` (no IO)."""
    if len(path) > MAX_PATH or "\0" in path:
        return "the rendezvous path is too long or holds a NUL"
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        return "the rendezvous path is not absolute and normalised"
    parent = Path(path).parent
    if Path(path).name != STORE_FILE or creator_pid(parent, STORE_PREFIX) is None:
        return f"the rendezvous path does not name {STORE_PREFIX}.../{STORE_FILE}"
    return None


def open_file_store(path: str, timeout: timedelta) -> FileStore:
    """A store on the trainer's rendezvous file at ``path``, once it passed every check.

    Raises :class:`ProtocolError` naming the path and what is wrong with it.
    """
    problem = check_store_path(path)
    if problem is not None:
        raise ProtocolError(f"collective plane refused: {problem}")
    if os.path.realpath(path) != path:
        raise ProtocolError(f"rendezvous file {path}: a component of its path is a symlink")
    uid = os.geteuid()
    for where, want in ((str(Path(path).parent), stat.S_ISDIR), (path, stat.S_ISREG)):
        try:
            info = os.lstat(where)
        except FileNotFoundError:
            raise ProtocolError(
                f"rendezvous file {path} is not on this host: an engine on another host, in "
                "another container or of another user needs the trainer's "
                "CollectiveOptions(rendezvous='tcp')"
            ) from None
        except OSError as exc:
            raise ProtocolError(f"rendezvous file {path}: cannot look at {where}: {exc}") from None
        if not want(info.st_mode):
            raise ProtocolError(f"rendezvous file {path}: {where} is not what it should be")
        if info.st_uid != uid:
            raise ProtocolError(
                f"rendezvous file {path}: {where} is owned by uid {info.st_uid}, not this "
                f"engine's ({uid}); a trainer of another user needs rendezvous='tcp'"
            )
        if info.st_mode & 0o077:
            raise ProtocolError(f"rendezvous file {path}: {where} is open to other users")
        if stat.S_ISREG(info.st_mode) and info.st_nlink != 1:
            raise ProtocolError(f"rendezvous file {path} has {info.st_nlink} links")
    return _file_store(path, timeout)


def _file_store(path: str, timeout: timedelta) -> FileStore:
    store = FileStore(path, -1)  # -1: torch never removes the file; its creator does
    store.set_timeout(timeout)
    return store
