"""ZMQ control channels: a DEALER (or a caller's REQ) to one peer, a ROUTER for many.

:class:`ZmqChannel` connects to one peer; its :meth:`~ZmqChannel.recv` also watches the
connection, so a peer process that dies is noticed at once rather than after a timeout.
:class:`ZmqListener` binds a ROUTER and yields a channel per peer identity; its
:meth:`~ZmqListener.accept` loop is also what delivers every peer's messages, so whoever
owns a listener keeps one task accepting. Every ZMQ error becomes an aiosync error here.
"""

from __future__ import annotations

import errno
import logging
import shutil
import socket as pysocket
from pathlib import Path

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aiosync.core.errors import AiosyncError, ErrorMap, PeerGoneError, map_exceptions
from aiosync.private_dirs import make_private_dir

log = logging.getLogger(__name__)

PEER_QUEUE = 256
"""Messages buffered per peer of a listener; beyond that a peer's messages are dropped."""


def _zmq_error(endpoint: str) -> ErrorMap:
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


def private_ipc_endpoint(name: str = "engine") -> tuple[str, Path]:
    """A fresh ``ipc://`` endpoint inside a new directory only this user can enter.

    Returns the endpoint and the directory, which the caller removes when done.
    """
    directory = make_private_dir()
    return f"ipc://{directory / (name + '.sock')}", directory


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


def _refuse_live_ipc(endpoint: str) -> None:
    """Refuse an ``ipc://`` path a live process listens on; remove a dead one's socket file."""
    path = _ipc_path(endpoint)
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
    raise AiosyncError(f"address in use: {endpoint} is bound by a live process")


class ZmqChannel:
    """A connection to one peer through a DEALER socket, or through a caller's socket.

    A REQ socket allows one message awaiting its reply (``window`` 1) and no unasked
    messages; after a failure its state is unknown and the caller must replace it.
    """

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        *,
        endpoint: str,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._socket = socket
        self._endpoint = endpoint
        self._context = context
        self._window = 1 if socket.type == zmq.REQ else None
        self._lost = anyio.Event()
        self._monitor: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        self._poller.register(socket, zmq.POLLIN)
        if context is not None:  # only watch sockets this channel owns
            self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller.register(self._monitor, zmq.POLLIN)
        self._errors = _zmq_error(endpoint)

    @classmethod
    def connect(cls, endpoint: str) -> ZmqChannel:
        """Connect a new DEALER socket, in a context of its own, to ``endpoint``."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            with map_exceptions(_zmq_error(endpoint)):
                sock.connect(endpoint)
        except BaseException:
            sock.close(linger=0)
            ctx.term()
            raise
        return cls(sock, endpoint=endpoint, context=ctx)

    @classmethod
    def wrap(cls, socket: zmq.Socket[bytes]) -> ZmqChannel:
        """Drive a caller's (blocking) REQ or DEALER socket from asyncio; not closed here."""
        if socket.type not in (zmq.REQ, zmq.DEALER):
            raise ValueError("a sender needs a REQ or DEALER socket")
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT) or "<caller's socket>"
        return cls(zmq.asyncio.Socket.shadow(socket.underlying), endpoint=endpoint)

    @property
    def peer(self) -> str:
        """The endpoint connected to."""
        return self._endpoint

    @property
    def window(self) -> int | None:
        """1 for a REQ socket, else None."""
        return self._window

    @property
    def lost(self) -> anyio.Event:
        """Set when the connection to the peer drops (seen while receiving)."""
        return self._lost

    async def send(self, payload: bytes) -> None:
        """Send one message (REQ sockets add their own empty delimiter)."""
        with map_exceptions(self._errors):
            await self._socket.send(payload)

    async def recv(self) -> bytes:
        """The next message; :class:`PeerGoneError` as soon as the connection drops."""
        with map_exceptions(self._errors):
            while True:
                if self._lost.is_set():
                    raise PeerGoneError("peer disconnected", peer=self._endpoint)
                ready = dict(await self._poller.poll())
                if self._monitor is not None and self._monitor in ready:
                    event = parse_monitor_message(await self._monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self._lost.set()
                    continue
                if self._socket in ready:
                    frames = await self._socket.recv_multipart()
                    return bytes(frames[-1])

    async def aclose(self) -> None:
        """Close socket and context if this channel made them."""
        if self._context is None:
            return
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._socket.close(linger=0)
        self._context.term()
        self._context = None


class RouterPeer:
    """One peer of a :class:`ZmqListener`: replies go out through the shared ROUTER."""

    def __init__(self, listener: ZmqListener, identity: bytes, *, delimited: bool) -> None:
        self._listener = listener
        self.identity = identity
        self._envelope = [identity, b""] if delimited else [identity]
        self._peer = f"peer-{identity.hex()}"
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](PEER_QUEUE)
        self._lost = anyio.Event()

    @property
    def peer(self) -> str:
        """``peer-<routing id in hex>``."""
        return self._peer

    @property
    def window(self) -> int | None:
        """No limit."""
        return None

    @property
    def lost(self) -> anyio.Event:
        """Set when a reply finds the peer gone."""
        return self._lost

    def deliver(self, payload: bytes) -> None:
        """Queue a message from the peer; dropped (and logged) when the queue is full."""
        try:
            self._tx.send_nowait(payload)
        except anyio.WouldBlock:
            log.warning("%s sends faster than it is served; message dropped", self._peer)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def send(self, payload: bytes) -> None:
        """Reply to the peer; :class:`PeerGoneError` if it has disconnected."""
        try:
            await self._listener.send_to(self._envelope, payload)
        except PeerGoneError:
            self._lost.set()
            raise

    async def recv(self) -> bytes:
        """The next message the listener's accept loop delivered."""
        try:
            return await self._rx.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise PeerGoneError("peer channel closed", peer=self._peer) from None

    async def aclose(self) -> None:
        """Forget the peer; a later message from the same identity makes a new channel."""
        self._listener.forget(self.identity)
        self._tx.close()
        self._rx.close()


class ZmqListener:
    """A bound ROUTER socket; :meth:`accept` yields a :class:`RouterPeer` per new identity."""

    def __init__(self, endpoint: str, *, private_dir: Path | None = None) -> None:
        self._private_dir = private_dir
        self._errors = _zmq_error(endpoint)
        _refuse_live_ipc(endpoint)
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._peers: dict[bytes, RouterPeer] = {}
        try:
            with map_exceptions(self._errors):
                self._socket.bind(endpoint)
        except BaseException:
            self._socket.close(linger=0)
            self._ctx.term()
            self._remove_private_dir()
            raise
        self._endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    @classmethod
    def open(cls, endpoint: str | None = None) -> ZmqListener:
        """Bind ``endpoint``, or ``ipc://`` in a new private directory (removed on close)."""
        if endpoint is not None:
            return cls(endpoint)
        endpoint, directory = private_ipc_endpoint()
        return cls(endpoint, private_dir=directory)

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    @property
    def endpoint(self) -> str:
        """The bound address (with the port chosen for ``tcp://...:0``)."""
        return self._endpoint

    async def accept(self) -> RouterPeer:
        """Deliver messages to known peers until one arrives from a new identity."""
        with map_exceptions(self._errors):
            while True:
                frames = await self._socket.recv_multipart()
                # [identity, payload] from a DEALER; [identity, b"", payload] from a REQ
                delimited = len(frames) == 3 and not frames[1]
                if len(frames) != 2 and not delimited:
                    log.warning("dropping a message of %d frames", len(frames))
                    continue
                identity, payload = bytes(frames[0]), bytes(frames[-1])
                known = self._peers.get(identity)
                if known is not None:
                    known.deliver(payload)
                    continue
                peer = RouterPeer(self, identity, delimited=delimited)
                self._peers[identity] = peer
                peer.deliver(payload)
                return peer

    async def send_to(self, envelope: list[bytes], payload: bytes) -> None:
        """Send to one peer along its envelope (routing id, and the delimiter of a REQ)."""
        with map_exceptions(self._errors):
            await self._socket.send_multipart([*envelope, payload])

    def forget(self, identity: bytes) -> None:
        """Drop a peer's channel (its next message starts a new one)."""
        self._peers.pop(identity, None)

    async def aclose(self) -> None:
        """Close the socket and context, and remove an ``ipc://`` socket file."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            await peer.aclose()
        self._socket.close(linger=0)
        self._ctx.term()
        path = _ipc_path(self._endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
        self._remove_private_dir()
