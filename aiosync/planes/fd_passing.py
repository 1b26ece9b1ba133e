"""File descriptors of trainer memory, passed to engines over a UNIX socket (``SCM_RIGHTS``).

A trainer in direct mode whose tensors live in CUDA physical allocations
(:class:`~aiosync.core.plane_specs.CudaFdRegion`) runs an :class:`FdServer`; an engine
fetches a region's descriptors with :func:`fetch_fds` when it first opens the region. No
``pidfd_getfd`` (which needs ``CAP_SYS_PTRACE`` or a permissive ptrace scope): the trainer
sends the descriptors itself. Nothing here knows CUDA: the server asks an ``exporter``
for ``(descriptor, size)`` pairs, and tests hand it plain files.

The socket is ``SOCK_SEQPACKET`` (each message arrives whole, with its descriptors) in a
private directory (:func:`~aiosync.private_dirs.make_private_dir`: only the trainer's user
may enter); the hello names it in a :class:`~aiosync.core.plane_specs.DescriptorSource`,
with the trainer's pid and a random token. One connection a region: the engine asks for
its pieces :data:`FDS_PER_MESSAGE` at a time (:class:`FdRequest`), each answer an
:class:`FdReply` with the descriptors attached.

- The server answers only a peer of its own user (``SO_PEERCRED``) that shows the token
  (compared in constant time), for a range within the region, and closes every descriptor
  it exported once sent (or not). It serves one connection at a time, each within
  :data:`FD_TIMEOUT` a message, on a daemon thread started by the first region published.
- The engine accepts descriptors only from the trainer of its hello: the socket's peer must
  be this user and, in the same PID namespace, the hello's pid (another namespace is
  refused: its pid cannot be checked). Each answer must carry exactly the descriptors asked
  for, none cut off (``MSG_CTRUNC``), with one size each. Descriptors arrive close-on-exec
  and are closed as soon as the caller has taken their batch, or anything failed.
"""

from __future__ import annotations

import array
import contextlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import struct
import threading
from collections.abc import Callable

import msgspec

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.plane_specs import DescriptorSource
from aiosync.private_dirs import make_private_dir, pid_namespace

log = logging.getLogger(__name__)

FDS_PER_MESSAGE = 64
"""Descriptors one answer carries at most (the kernel's bound is 253 a message)."""
MAX_PIECES = 4096
"""Descriptors one region may have (one a physical allocation)."""
MAX_MESSAGE = 1 << 16
"""Bytes of one request or answer at most."""
FD_TIMEOUT = 10.0
"""Seconds either side waits for the other's next message."""
ACCEPT_POLL = 0.5
"""Seconds between a server's checks that it is to stop."""

Exporter = Callable[[int, int, int], list[tuple[int, int]]]
"""``(ident, start, count)`` -> one ``(descriptor, size)`` per piece ``start ..
start + count`` of region ``ident``; raises :class:`AiosyncError` to refuse."""

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_INT = array.array("i")  # a descriptor as SCM_RIGHTS carries it


class FdRequest(msgspec.Struct, frozen=True, tag="fd_request"):
    """Engine -> trainer: the descriptors of pieces ``start .. start + count`` of ``ident``."""

    token: bytes
    ident: int
    start: int
    count: int


class FdReply(msgspec.Struct, frozen=True, tag="fd_reply"):
    """Trainer -> engine: one size a descriptor attached, or why none is (``error``)."""

    sizes: list[int] = []
    error: str = ""


_requests = msgspec.msgpack.Decoder(FdRequest)
_replies = msgspec.msgpack.Decoder(FdReply)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid, uid and gid of a connected UNIX socket's peer (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(raw)
    return pid, uid, gid


class FdServer:
    """Serves the descriptors ``exporter`` makes to the engines that show :attr:`source`'s token.

    ``prepare`` runs once on the serving thread before its first answer (a CUDA device
    made current there). Bound at once; serving starts with :meth:`start`. Raises
    :class:`OSError` where no socket can be made.
    """

    def __init__(self, exporter: Exporter, prepare: Callable[[], None] | None = None) -> None:
        self._exporter = exporter
        self._prepare = prepare
        self._directory = make_private_dir()
        path = self._directory / "regions.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._listener.bind(str(path))
            self._listener.listen(16)
            self._listener.settimeout(ACCEPT_POLL)
        except BaseException:
            self._listener.close()
            shutil.rmtree(self._directory, ignore_errors=True)
            raise
        token = secrets.token_bytes(32)
        self.source = DescriptorSource(str(path), os.getpid(), pid_namespace(), token)
        """What the hello tells engines: the socket, this process and the token."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start serving on a daemon thread (idempotent; not after :meth:`close`)."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="aiosync-fd-server", daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """Stop serving, close the socket and remove its directory (idempotent)."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            with (
                contextlib.suppress(OSError),
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as wake,
            ):
                wake.connect(self.source.path)  # its accept returns now, and sees the stop
            thread.join(timeout=FD_TIMEOUT + ACCEPT_POLL)
        self._listener.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    def _run(self) -> None:
        try:
            if self._prepare is not None:
                self._prepare()
        except Exception:
            log.exception("the descriptor server cannot start: no engine gets descriptors")
            return
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                if self._stop.is_set():
                    return
                try:
                    self._serve(conn)
                except Exception as exc:  # one engine's trouble; the next may connect
                    log.warning("a descriptor request failed: %s", exc)

    def _serve(self, conn: socket.socket) -> None:
        """Answer one connection's requests until it closes (at most a region's worth)."""
        conn.settimeout(FD_TIMEOUT)
        _, uid, _ = peer_credentials(conn)
        if uid != os.geteuid():
            log.warning("refused a descriptor request from uid %d", uid)
            return
        for _ in range(-(-MAX_PIECES // FDS_PER_MESSAGE)):
            data = conn.recv(MAX_MESSAGE)
            if not data:
                return
            reply, fds = self._answer(data)
            try:
                socket.send_fds(conn, [msgspec.msgpack.encode(reply)], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            if reply.error:
                return

    def _answer(self, data: bytes) -> tuple[FdReply, list[int]]:
        """The reply to one request, and the descriptors to attach (the caller closes them)."""
        try:
            request = _requests.decode(data)
        except msgspec.MsgspecError:
            return FdReply(error="not a descriptor request"), []
        if not hmac.compare_digest(request.token, self.source.token):
            return FdReply(error="wrong token"), []
        if not (0 <= request.start < MAX_PIECES and 0 < request.count <= FDS_PER_MESSAGE):
            return FdReply(error=f"pieces {request.start}+{request.count} out of bounds"), []
        try:
            pairs = self._exporter(request.ident, request.start, request.count)
        except AiosyncError as exc:
            return FdReply(error=exc.reason), []
        except Exception as exc:
            log.exception("exporting region %d failed", request.ident)
            return FdReply(error=f"export failed: {exc}"), []
        if len(pairs) != request.count:
            for fd, _ in pairs:
                os.close(fd)
            return FdReply(error=f"{len(pairs)} pieces, not {request.count}"), []
        return FdReply(sizes=[size for _, size in pairs]), [fd for fd, _ in pairs]


def fetch_fds(
    source: DescriptorSource,
    ident: int,
    count: int,
    take: Callable[[list[tuple[int, int]]], None],
    timeout: float = FD_TIMEOUT,
) -> None:
    """Hand ``take`` the ``count`` descriptors of region ``ident``, a batch at a time.

    Each batch is a list of ``(descriptor, size)``, in order, which ``take`` may use until
    it returns; they are closed then, whatever happens (so at most
    :data:`FDS_PER_MESSAGE` are open at once). Raises :class:`AiosyncError` when the
    trainer ``source`` names cannot be reached, is not the process the hello named, or
    refuses; :class:`ProtocolError` when an answer is not what was asked for.
    """
    if not 0 < count <= MAX_PIECES:
        raise ProtocolError(f"a region of {count} pieces (1-{MAX_PIECES})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(source.path)
        except OSError as exc:
            raise AiosyncError(
                f"cannot reach the trainer's descriptor socket {source.path}: {exc} (an "
                "engine reading a trainer's memory runs on its host, as its user)"
            ) from None
        check_peer(sock, source)
        for start in range(0, count, FDS_PER_MESSAGE):
            wanted = min(FDS_PER_MESSAGE, count - start)
            reply, fds = _ask(sock, FdRequest(source.token, ident, start, wanted))
            try:
                if reply.error:
                    raise AiosyncError(f"the trainer refused region {ident}: {reply.error}")
                if len(fds) != wanted or len(reply.sizes) != wanted:
                    raise ProtocolError(
                        f"{len(fds)} descriptors and {len(reply.sizes)} sizes, not {wanted}"
                    )
                take(list(zip(fds, reply.sizes, strict=True)))
            finally:
                for fd in fds:
                    os.close(fd)


def _ask(sock: socket.socket, request: FdRequest) -> tuple[FdReply, list[int]]:
    """Send ``request``, and its answer with the descriptors attached (socket errors mapped)."""
    try:
        sock.send(msgspec.msgpack.encode(request))
        return receive(sock, request.count)
    except OSError as exc:  # a timeout included
        raise AiosyncError(f"the trainer's descriptor socket failed: {exc}") from None


def check_peer(sock: socket.socket, source: DescriptorSource) -> None:
    """Raise :class:`AiosyncError` unless ``sock``'s peer is the trainer ``source`` names."""
    try:
        pid, uid, _ = peer_credentials(sock)
    except OSError as exc:
        raise AiosyncError(f"the descriptor socket's peer is unknown: {exc}") from None
    if uid != os.geteuid():
        raise AiosyncError(f"the descriptor socket {source.path} is served by uid {uid}")
    if source.pid_namespace != pid_namespace():
        raise AiosyncError(
            "the trainer is in another PID namespace: its descriptor socket cannot be checked"
        )
    if pid != source.pid:
        raise AiosyncError(
            f"the descriptor socket {source.path} is served by pid {pid}, not the trainer's "
            f"{source.pid}"
        )


def receive(sock: socket.socket, most: int) -> tuple[FdReply, list[int]]:
    """One answer and the descriptors attached to it (at most ``most``; close-on-exec)."""
    data, ancillary, flags, _ = sock.recvmsg(
        MAX_MESSAGE, socket.CMSG_SPACE(most * _INT.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % _INT.itemsize
            fds.extend(array.array("i", payload[:whole]))
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise ProtocolError("an answer of the trainer's descriptor socket was cut short")
        if not data:
            raise AiosyncError("the trainer closed its descriptor socket")
        try:
            reply = _replies.decode(data)
        except msgspec.MsgspecError:
            raise ProtocolError("the trainer's descriptor socket sent no reply") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return reply, fds
