"""A TCPStore client whose connections can be cut from another thread.

torch's ``TCPStore`` client does not always honour its timeout: against a server that
accepts the connection and never answers (a silent listener, a frozen trainer) its
constructor, and later calls, block for good. A thread waiting there can be neither
cancelled nor timed out, so a peer could pin one engine thread, and its descriptors, per
hello. :class:`StoreDialer` notes the process's sockets before it connects; :meth:`cut`
shuts down (``shutdown(2)``, from any thread) every socket made since then whose peer is
the store's address, which makes the blocked call fail (torch may retry within its
current attempt, at most :data:`ATTEMPT` seconds, and is cut again). The plane cuts when
it closes and when its deadline passes (:meth:`cut_after`).

Sockets are found through ``/proc/self/fd`` and named by inode, so a descriptor number
reused meanwhile is never mistaken for one of the store's. They are told apart by their
peer only: two joins of one process to one store, both under way, are cut together.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore
from torch.distributed import DistNetworkError

from aiosync.collectives.rendezvous import valid_host
from aiosync.core.errors import PeerGoneError, SyncTimeoutError

_FDS = "/proc/self/fd"
ATTEMPT = 1.0
"""Seconds of one connection attempt (torch's own retries within it cannot be stopped)."""
KEEP_CUTTING = 0.02
"""Seconds between sweeps of a cut dialer whose join has not ended yet."""


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(host.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def socket_inodes() -> dict[int, int]:
    """The open sockets of this process: inode -> a descriptor (empty without ``/proc``)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FDS}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(target[8:-1])] = int(name)
    return found


class StoreDialer:
    """Connects to the store at ``host``:``port``; :meth:`cut` ends whatever that left open.

    One dialer serves one join: :meth:`connect`, the store calls that follow, then
    :meth:`done`. A cut before :meth:`done` shuts the sockets opened to the store since
    :meth:`connect` began, and keeps shutting new ones (torch's client reconnects) until
    :meth:`done`; after it, a cut does nothing, as the join let go of its client.
    """

    def __init__(self, host: str, port: int) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"not a port: {port}")
        self.host, self.port = valid_host(host), port
        self._peer = (_address(host), port)
        self._before: set[int] | None = None  # socket inodes open before connecting
        self._cut = False
        self._timed_out = False
        self._finished = False
        self._keeper: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def connect(self, timeout: timedelta) -> TCPStore:
        """A client of the store, within ``timeout`` (blocking).

        Tries in turns of at most :data:`ATTEMPT` seconds (torch retries a refused connect
        until its timeout, uninterrupted), so a cut stops the trying within one turn.
        Raises :class:`PeerGoneError` once cut, :class:`SyncTimeoutError` past ``timeout``.
        """
        end = time.monotonic() + timeout.total_seconds()
        while True:
            with self._lock:
                if self._cut:
                    raise self._cut_error()
                if self._before is None:
                    self._before = set(socket_inodes())
            turn = min(ATTEMPT, end - time.monotonic())
            if turn <= 0:
                raise SyncTimeoutError(
                    f"store {self.host}:{self.port} did not answer within "
                    f"{timeout.total_seconds():g}s"
                )
            try:
                store = TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=turn))
            except DistNetworkError:
                continue
            store.set_timeout(timeout)
            return store

    def cut_after(self, seconds: float) -> None:
        """Cut once ``seconds`` have passed, unless :meth:`done` comes first."""
        timer = threading.Timer(seconds, self.cut, kwargs={"timed_out": True})
        timer.daemon = True
        timer.name = f"aiosync-store-cut-{self.port}"
        with self._lock:
            if self._cut or self._finished:
                return
            self._timer = timer
        timer.start()

    def done(self) -> None:
        """The join is over (its client let go of): no cut comes any more."""
        with self._lock:
            self._finished = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def cut(self, *, timed_out: bool = False) -> int:
        """Shut down every socket opened to the store since :meth:`connect`; how many.

        Idempotent and thread-safe; later connects fail at once (``timed_out``: with a
        :class:`SyncTimeoutError`, as at the deadline). Until :meth:`done`, a thread goes
        on shutting the sockets torch opens again.
        """
        with self._lock:
            self._timed_out = self._timed_out or (timed_out and not self._cut)
            self._cut = True
            before = self._before
            timer, self._timer = self._timer, None
            keeper = None
            if before is not None and not self._finished and self._keeper is None:
                keeper = self._keeper = threading.Thread(
                    target=self._keep_cutting, args=(before,), daemon=True,
                    name=f"aiosync-store-cut-{self.port}",
                )  # fmt: skip
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
        if before is None or self._finished:
            return 0
        cut = self._sweep(before)
        if keeper is not None:
            keeper.start()
        return cut

    def _keep_cutting(self, before: set[int]) -> None:
        while True:
            with self._lock:
                if self._finished:
                    return
            self._sweep(before)
            time.sleep(KEEP_CUTTING)

    def _sweep(self, before: set[int]) -> int:
        new = socket_inodes()
        return sum(self._shut(inode, fd) for inode, fd in new.items() if inode not in before)

    def _cut_error(self) -> PeerGoneError | SyncTimeoutError:
        where = f"store {self.host}:{self.port}"
        if self._timed_out:
            return SyncTimeoutError(f"{where}: the rendezvous passed its deadline; cut")
        return PeerGoneError(f"{where}: the plane closed during the rendezvous; cut")

    def _shut(self, inode: int, fd: int) -> bool:
        try:
            copy = os.dup(fd)
        except OSError:
            return False
        try:
            if os.fstat(copy).st_ino != inode:  # the number was reused meanwhile
                return False
            with socket.socket(fileno=copy) as sock:
                copy = -1  # closed with sock
                peer = sock.getpeername()
                if not isinstance(peer, tuple) or (_address(peer[0]), peer[1]) != self._peer:
                    return False
                sock.shutdown(socket.SHUT_RDWR)  # the descriptor torch holds is shut too
                return True
        except (OSError, ValueError):
            return False
        finally:
            if copy >= 0:
                os.close(copy)
