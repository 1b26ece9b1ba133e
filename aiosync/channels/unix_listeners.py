"""Who listens on an ``ipc://`` path: finding a socket that a second bind displaced.

Binding an ``ipc://`` path that a live socket holds does not fail in ZMQ: the second bind
removes the socket file and makes its own, and the first socket goes on listening where
nothing can reach it. aiosync's own listeners refuse a live path before they bind
(:func:`~aiosync.channels.zmq_common.refuse_live_ipc`), but a caller's socket (NeMo-RL's
policy worker binds its REQ socket itself) binds without asking. :func:`refuse_double_bind`
finds that afterwards: it asks the kernel (``NETLINK_SOCK_DIAG``, the ``unix_diag`` interface
``ss -xl`` uses) for every listening unix socket bound to the path's name, and calls the path
bound twice when one of them bound a socket file, on the path's filesystem, that is no longer
the one at the path.

The kernel reports the sockets of this network namespace only, and a listener in another
mount namespace is told apart by its filesystem, not by its directory: two containers with
one network and the same ``/tmp`` filesystem mounted at different places could look alike.
Where the kernel has no ``unix_diag`` (or it cannot be asked), nothing is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from dataclasses import dataclass

from aiosync.core.errors import AiosyncError

log = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN = 10
UDIAG_SHOW_NAME, UDIAG_SHOW_VFS = 0x1, 0x2
UNIX_DIAG_NAME, UNIX_DIAG_VFS = 0, 1
DIAG_TIMEOUT = 2.0  # seconds the kernel may take to answer one dump

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_REQUEST = struct.Struct("=BBHIIIII")  # unix_diag_req
_MESSAGE = struct.Struct("=BBBBIII")  # unix_diag_msg: family, type, state, pad, ino, cookie
_ATTR = struct.Struct("=HH")  # rtattr: length, type
_VFS = struct.Struct("=II")  # unix_diag_vfs: inode, device (the kernel's encoding)


@dataclass(frozen=True)
class UnixListener:
    """One listening unix socket: its own inode, the name it bound, and the file it made.

    ``file`` is the ``(st_dev, st_ino)`` of the socket file the bind created (None for an
    abstract name, which has no file).
    """

    inode: int
    name: bytes
    file: tuple[int, int] | None


def diag_request(seq: int = 1) -> bytes:
    """The netlink message asking for every listening unix socket, with names and files."""
    body = _REQUEST.pack(
        socket.AF_UNIX, 0, 0, 1 << TCP_LISTEN, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_VFS, 0, 0
    )
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body


def _kernel_dev(encoded: int) -> int:
    """The ``st_dev`` of a device number as the kernel keeps it (major << 20 | minor)."""
    return os.makedev(encoded >> 20, encoded & 0xFFFFF)


def parse_diag(data: bytes) -> tuple[list[UnixListener], bool]:
    """The listeners in one netlink reply, and whether the dump is complete.

    A netlink error (the kernel has no ``unix_diag``) is an ``OSError`` with its errno.
    """
    listeners: list[UnixListener] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            break
        body = data[offset + _HEADER.size : offset + length]
        offset += (length + 3) & ~3
        if kind == NLMSG_DONE:
            return listeners, True
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", body)[0] if len(body) >= 4 else errno.EIO
            raise OSError(code, f"sock_diag: {os.strerror(code)}")
        if kind != SOCK_DIAG_BY_FAMILY or len(body) < _MESSAGE.size:
            continue
        inode = _MESSAGE.unpack_from(body)[4]
        name, file = b"", None
        at = _MESSAGE.size
        while at + _ATTR.size <= len(body):
            size, attr = _ATTR.unpack_from(body, at)
            if size < _ATTR.size:
                break
            value = body[at + _ATTR.size : at + size]
            if attr == UNIX_DIAG_NAME:  # a path's name ends in NUL; an abstract one starts so
                name = value if value[:1] == b"\0" else value.rstrip(b"\0")
            elif attr == UNIX_DIAG_VFS and len(value) >= _VFS.size:
                ino, dev = _VFS.unpack_from(value)
                file = (_kernel_dev(dev), ino)
            at += (size + 3) & ~3
        listeners.append(UnixListener(inode, name, file))
    return listeners, False


def listening_unix_sockets() -> list[UnixListener] | None:
    """Every listening unix socket of this network namespace; None if the kernel won't say."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as diag:
            diag.settimeout(DIAG_TIMEOUT)
            diag.sendall(diag_request())
            found: list[UnixListener] = []
            while True:
                listeners, done = parse_diag(diag.recv(1 << 16))
                found += listeners
                if done:
                    return found
    except (OSError, AttributeError) as exc:  # no AF_NETLINK off Linux: AttributeError
        log.debug("cannot list unix listeners: %s", exc)
        return None


def displaced(listeners: list[UnixListener], path: str, current: os.stat_result) -> list[int]:
    """The listeners bound to ``path`` on its filesystem whose file is not the one there now.

    ``current`` is the path's ``os.stat``. Returns their socket inodes.
    """
    name = os.fsencode(path)
    return [
        one.inode
        for one in listeners
        if one.name == name
        and one.file is not None
        and one.file[0] == current.st_dev
        and one.file[1] != current.st_ino
    ]


def refuse_double_bind(endpoint: str) -> None:
    """Raise :class:`AiosyncError` naming ``endpoint`` if two live sockets bound its path.

    Only absolute ``ipc://`` paths are checked (a relative one names other files in other
    directories); anything else, a path nobody holds, or a kernel that cannot be asked,
    passes.
    """
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or not os.path.isabs(path):
        return
    try:
        current = os.stat(path)
    except OSError:
        return
    listeners = listening_unix_sockets()
    if listeners is None or not displaced(listeners, path, current):
        return
    raise AiosyncError(
        f"{endpoint} is bound twice: a later bind took the path over from a socket still "
        "listening there, which nothing can reach now. Bind it on one side only: an engine "
        f"reaches a trainer's bound socket by connecting (WeightReceiver(sink, "
        f"connect={endpoint!r}), or BackgroundReceiver(..., connect=...)); a trainer "
        "socket that connects needs the engine bound there"
    )
