"""What the ZMQ channels share: error mapping, endpoint rules, and private ``ipc://`` paths.

Who may use which endpoint (see docs/security.md): ``ipc://`` needs no keys (the default
endpoint lives in a directory only this user can enter); ``tcp://`` needs CURVE keys
(:class:`~aiosync.channels.keys.ChannelAuth`) whichever side binds, except on a loopback
address with ``ChannelAuth(insecure_loopback=True)``. :func:`curve_keys` decides this for
both :class:`~aiosync.channels.zmq.ZmqChannel` and
:class:`~aiosync.channels.zmq_listener.ZmqListener`. Every ZMQ error becomes an aiosync
error through :func:`zmq_error`. The underscored helpers here are shared by those two
modules only.
"""

from __future__ import annotations

import errno
import logging
import socket as pysocket
from pathlib import Path

import zmq

from aiosync.channels.endpoints import is_loopback_endpoint, plain_refusal
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import AiosyncError, ErrorMap, PeerGoneError
from aiosync.private_dirs import make_private_dir

log = logging.getLogger("aiosync.channels.zmq")  # the name it logged under before the split

CLOSE_LINGER_MS = 250
"""How long closing a socket may still flush its queued messages (a last ack, a goodbye).

Bounded, so a close never hangs on a dead peer; zero would drop an engine's final commit
ack when it exits right after committing.
"""


def zmq_error(endpoint: str) -> ErrorMap:
    """Map a ``zmq.ZMQError`` on ``endpoint`` to the package's errors (address in use, gone)."""

    def build(exc: BaseException) -> AiosyncError:
        code = getattr(exc, "errno", None)
        if code == errno.EADDRINUSE:
            return AiosyncError(f"address in use: {endpoint}")
        if code in (errno.EINVAL, errno.EPROTONOSUPPORT, errno.ENODEV, errno.ENOENT):
            return AiosyncError(f"bad address {endpoint!r}: {exc}")
        if code in (zmq.EHOSTUNREACH, zmq.ETERM, errno.ENOTSOCK):
            return PeerGoneError(f"connection closed: {exc}", peer=endpoint)
        return AiosyncError(f"zmq error on {endpoint}: {exc}")

    return {zmq.ZMQError: build}


# --- who may use which endpoint --------------------------------------------------------------


def wants_ipv6(endpoint: str) -> bool:
    """True for a ``tcp://`` endpoint with a bracketed (IPv6) address, which zmq needs told."""
    return endpoint.startswith("tcp://") and "[" in endpoint


def curve_keys(endpoint: str, auth: ChannelAuth | None, *, binding: bool) -> ChannelAuth | None:
    """The keys ``endpoint`` is used with (None: plain), or AiosyncError if it may not be.

    Keys given are always used, on any transport. Without keys: ``ipc://`` is allowed;
    ``tcp://`` only on a loopback address and only with ``insecure_loopback``; other
    network transports never (:func:`~aiosync.channels.endpoints.plain_refusal`). Unknown
    schemes are left to zmq, which refuses them as bad addresses; no scheme at all, and
    ``inproc://``, are refused before (:func:`~aiosync.channels.endpoints.check_endpoint`).
    """
    if auth is not None and auth.has_keys:
        role = "bind" if binding else "connect to"
        try:
            auth.server_keys() if binding else auth.client_keys()
        except AiosyncError as exc:
            raise AiosyncError(f"cannot {role} {endpoint} with CURVE: {exc.reason}") from None
        return auth
    insecure = auth is not None and auth.insecure_loopback
    refusal = plain_refusal(endpoint, insecure_loopback=insecure)
    if refusal is None:
        if insecure and is_loopback_endpoint(endpoint):
            log.warning("plain tcp on %s: any local user can connect (insecure_loopback)", endpoint)
        return None
    if refusal == "loopback":
        raise AiosyncError(
            f"{endpoint} is not a loopback address: insecure_loopback allows plain tcp only "
            "on 127.0.0.1, ::1 or localhost; use CURVE keys (aiosync keygen)"
        )
    raise AiosyncError(
        f"{endpoint} needs CURVE keys: pass auth=ChannelAuth(...) with keypairs made by "
        "'aiosync keygen' (plain tcp only on loopback, with ChannelAuth(insecure_loopback=True))"
    )


# --- ipc ---------------------------------------------------------------------------------------


def private_ipc_endpoint(name: str = "engine") -> tuple[str, Path]:
    """A fresh ``ipc://`` endpoint inside a new directory only this user can enter.

    Returns the endpoint and the directory, which the caller removes when done.
    """
    directory = make_private_dir()
    return f"ipc://{directory / (name + '.sock')}", directory


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint; None for any other transport."""
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


def refuse_live_ipc(endpoint: str) -> None:
    """Refuse an ``ipc://`` path a live process listens on; remove a dead one's socket file."""
    path = ipc_path(endpoint)
    if path is None or not path.exists():
        return
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # left by a process that died
        return
    except OSError as exc:
        raise AiosyncError(f"cannot use {endpoint}: {exc}") from None
    finally:
        probe.close()
    raise AiosyncError(
        f"address in use: {endpoint} is bound by a live process (a trainer's socket bound "
        f"there? then connect to it: WeightReceiver(sink, connect={endpoint!r}))"
    )
