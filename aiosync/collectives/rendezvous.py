"""Where the ranks of a side group meet: a TCPStore on a chosen interface, and a token.

torch's ``TCPStore`` server listens on every interface of the host when it opens its own
socket. :func:`host_store` binds the listening socket itself (loopback by default, or the
address of one named interface) and hands it to the store, so the rendezvous is reachable
only where the caller chose.

Each group's keys go under a prefix holding a random token (:func:`new_token`,
:func:`token_store`). The token travels to engines over aiosync's authenticated control
channel (inside the plane spec of the hello); a process that reaches the store without the
token writes and waits on keys nobody else uses. The store itself, like NCCL and Gloo
traffic, is not authenticated or encrypted (docs/security.md).
"""

from __future__ import annotations

import fcntl
import ipaddress
import secrets
import socket
import struct
from collections.abc import Sequence
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

LOOPBACK = "127.0.0.1"
TOKEN_BYTES = 16
TOKEN_HEX = 2 * TOKEN_BYTES
_SIOCGIFADDR = 0x8915


def new_token() -> str:
    """A fresh random token for one group's key prefix (hex, 128 bits)."""
    return secrets.token_hex(TOKEN_BYTES)


def is_token(value: str) -> bool:
    """True when ``value`` looks like a token from :func:`new_token` (checks hostile input)."""
    return len(value) == TOKEN_HEX and all(c in "0123456789abcdef" for c in value)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (``"lo"``, ``"eth0"``...)."""
    if not name or len(name) >= 16:
        raise ValueError(f"not an interface name: {name!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError as exc:
            raise ValueError(f"no IPv4 address on interface {name!r}: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def valid_host(host: str) -> str:
    """``host`` if it is a literal IPv4/IPv6 address (no names: nothing to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"not an IP address: {host!r}") from None
    return host


class HostedStore:
    """A TCPStore server this process owns, listening on one address only.

    ``store`` is the server's own client; ``host`` and ``port`` are what peers connect to.
    The store owns the listening socket: torch closes it with the server, once this object,
    the store and every group made from it are gone.
    """

    def __init__(self, host: str = LOOPBACK, *, timeout: timedelta) -> None:
        family = socket.AF_INET6 if ":" in valid_host(host) else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        try:
            listening.bind((host, 0))
            listening.listen(128)
            self.host = host
            self.port: int = listening.getsockname()[1]
            try:
                self.store = _serve(host, self.port, timeout, listening.fileno(), libuv=True)
            except RuntimeError:  # a torch whose libuv server cannot take a socket
                self.store = _serve(host, self.port, timeout, listening.fileno(), libuv=False)
        except BaseException:
            listening.close()
            raise
        listening.detach()  # the store's server owns the descriptor now

    def close(self) -> None:
        """Nothing to release here: the server stops once no store or group refers to it.

        (It owns its socket; closing the descriptor under it would be a double close.)
        """

    def __enter__(self) -> HostedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(host: str, port: int, timeout: timedelta, fd: int, *, libuv: bool) -> TCPStore:
    """A store server on the listening socket ``fd`` (which it then owns)."""
    return TCPStore(
        host,
        port,
        None,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=fd,
        use_libuv=libuv,
    )


def host_store(host: str = LOOPBACK, *, timeout: timedelta) -> HostedStore:
    """A store server listening on ``host`` only (loopback unless told otherwise)."""
    return HostedStore(host, timeout=timeout)


def connect_store(host: str, port: int, *, timeout: timedelta) -> TCPStore:
    """A client of the store at ``host``:``port`` (blocking until it answers or ``timeout``)."""
    if not 0 < port < 65536:
        raise ValueError(f"not a port: {port}")
    return TCPStore(valid_host(host), port, None, False, timeout=timeout)


def token_store(store: Store, token: str) -> PrefixStore:
    """``store`` seen through the prefix of ``token`` (what :func:`init_process_group` gets)."""
    if not is_token(token):
        raise ValueError("malformed rendezvous token")
    return PrefixStore(f"aiosync/{token}/", store)


class HeldStore(Store):
    """The store a side group is made with, let go of once the rendezvous is over.

    torch keeps a group's store for the group's life, and so would keep a ``TCPStore``
    server listening (and growing with whatever any client writes) as long as the group.
    Once every rank has joined (and proved itself, :mod:`aiosync.collectives.admission`)
    :meth:`release` drops ``inner``: a hosted server then stops once nothing else holds
    it. After that, writes are dropped, :meth:`check` finds no key (what NCCL's watchdog
    asks now and then), and reads or waits raise.
    """

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self._inner: Store | None = inner

    def release(self) -> None:
        """Let go of the inner store (idempotent)."""
        self._inner = None

    def _held(self) -> Store:
        inner = self._inner
        if inner is None:
            raise RuntimeError("the rendezvous is over: this group's store was released")
        return inner

    def set(self, key: str, value: str) -> None:  # type: ignore[override]
        """Set ``key`` (dropped once released)."""
        if self._inner is not None:
            self._inner.set(key, value)

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """Get ``key``."""
        return self._held().get(key)

    def add(self, key: str, value: int) -> int:  # type: ignore[override]
        """Add to counter ``key`` (nothing once released)."""
        return self._inner.add(key, value) if self._inner is not None else 0

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str, desired_value: str
    ) -> bytes:
        """Compare-and-set ``key``."""
        return self._held().compare_set(key, expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        """Wait for ``keys``."""
        if timeout is None:
            self._held().wait(list(keys))
        else:
            self._held().wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:  # type: ignore[override]
        """True when all ``keys`` exist (never, once released)."""
        return self._inner.check(list(keys)) if self._inner is not None else False

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        """Delete ``key``."""
        return self._inner.delete_key(key) if self._inner is not None else False

    def num_keys(self) -> int:  # type: ignore[override]
        """Keys in the inner store (0 once released)."""
        return self._inner.num_keys() if self._inner is not None else 0

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        """Set the inner store's timeout."""
        if self._inner is not None:
            self._inner.set_timeout(timeout)
