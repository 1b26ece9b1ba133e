"""Private temporary directories (for ``ipc://`` sockets) that outlive no process for long.

:func:`make_private_dir` creates ``aiosync-<pidns>-<pid>-<random>`` under the temporary
directory, mode 0700, where ``pidns`` identifies the creator's PID namespace and ``pid`` is
the creator itself. The creator removes its directory when done; one left by a process that
was killed before it could is removed by :func:`sweep_stale_dirs`, which every
:func:`make_private_dir` runs first, as
:func:`aiosync.planes.shm_files.sweep_stale_segments` does for shared-memory segments.

A directory is swept only when all of these hold: its whole name has the form above, its
pid namespace is this process's (a pid from another namespace, say another container
sharing ``/tmp``, says nothing here), no process with its pid exists, it is a real
directory (not a symlink) and this user (the effective uid) owns it. Removal never follows
symlinks, and the sweep is best effort: whatever it cannot look at or remove it leaves, and
it never raises, so nothing planted in the temporary directory can stop a process from
making its own directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "aiosync-"
# mkdtemp's random part: 8 characters of [a-z0-9_].
_RANDOM = r"[a-z0-9_]{8}"


def pid_namespace() -> int:
    """An id of this process's PID namespace (the inode of ``/proc/self/ns/pid``; 0 if unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """True when a process with ``pid`` exists in this PID namespace (even another user's)."""
    if pid <= 0:
        return True  # not a real creator pid: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # another user's (EPERM), or a number no pid can be: never call it dead
    return True


def _name_pattern(prefix: str) -> re.Pattern[str]:
    """The whole name (use ``fullmatch``); bounded numbers, so a planted name stays cheap."""
    return re.compile(rf"{re.escape(prefix)}(\d{{1,20}})-(\d{{1,10}})-{_RANDOM}")


def make_private_dir(prefix: str = PREFIX, parent: str | os.PathLike[str] | None = None) -> Path:
    """Create and return a new directory only this user can enter (mode 0700).

    Its name is ``<prefix><pidns>-<pid>-<random>`` under ``parent`` (default: the system's
    temporary directory). Stale directories of dead processes are swept first. The caller
    removes the directory when done (``shutil.rmtree``).
    """
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    sweep_stale_dirs(prefix=prefix, parent=base)
    name_prefix = f"{prefix}{pid_namespace()}-{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=name_prefix, dir=base))  # mkdtemp: mode 0700


def creator_pid(path: Path, prefix: str = PREFIX) -> int | None:
    """The pid in a private directory's name, or ``None`` when the name is not one of ours."""
    match = _name_pattern(prefix).fullmatch(path.name)
    return int(match.group(2)) if match else None


def dead_entries(
    entries: Iterable[os.DirEntry[str]],
    pattern: re.Pattern[str],
    is_kind: Callable[[int], bool],
) -> Iterator[os.DirEntry[str]]:
    """The entries a dead process of this PID namespace left, that this user may remove.

    ``pattern`` must match a whole name and capture the PID namespace and the pid; an entry
    is yielded only if that pid no longer exists here, and its own mode (looked at without
    following a symlink) passes ``is_kind`` and it belongs to this user. Never raises.
    """
    namespace = pid_namespace()
    if namespace == 0:  # without /proc no pid can be judged dead
        return
    uid = os.geteuid()
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match or int(match.group(1)) != namespace or pid_alive(int(match.group(2))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if is_kind(info.st_mode) and info.st_uid == uid:
            yield entry


def sweep_stale_dirs(
    prefix: str = PREFIX, parent: str | os.PathLike[str] | None = None
) -> list[str]:
    """Remove private directories whose creating process is gone; returns their names.

    Only directories named by :func:`make_private_dir` in this PID namespace, owned by this
    user and not symlinks are considered; see the module docstring. Never raises.
    """
    removed: list[str] = []
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    try:
        with os.scandir(base) as scan:
            entries = list(scan)
    except OSError:
        return removed
    for entry in dead_entries(entries, _name_pattern(prefix), stat.S_ISDIR):
        # rmtree works from descriptors and refuses a symlink, also one swapped in after
        # the look above; nothing inside is followed out.
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.name)
    if removed:
        log.warning("removed %d private directories left by dead processes", len(removed))
    return removed
