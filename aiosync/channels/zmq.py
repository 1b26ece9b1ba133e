"""ZMQ control channels: a DEALER (or a caller's REQ) to one peer, a ROUTER for many.

:class:`ZmqChannel` connects to one peer; its :meth:`~ZmqChannel.recv` also watches the
connection, so a peer process that dies (during the hello as during a stream) is noticed at
once rather than after a timeout. :class:`ZmqListener` binds a ROUTER and yields a channel
per peer identity; its :meth:`~ZmqListener.accept` loop is also what delivers every peer's
messages (and answers CURVE authentication requests), so whoever owns a listener keeps one
task accepting. Every ZMQ error becomes an aiosync error here.

Who may use which endpoint (see docs/security.md): ``ipc://`` needs no keys (the default
endpoint lives in a directory only this user can enter); ``tcp://`` needs CURVE keys
(:class:`~aiosync.channels.keys.ChannelAuth`) whichever side binds, except on a loopback
address with ``ChannelAuth(insecure_loopback=True)``. A listener with keys lets in only the
client keys it lists: a peer without one never gets a message through.

A listener never waits on a peer: replies go out without blocking, each peer may have at
most ``send_hwm`` replies queued, and a peer that lets its queue fill (it does not read) is
dropped with its reply. Peers are named ``peer-1``, ``peer-2``, ... by the listener, never by
their ZMQ routing ids, which a peer may choose.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import shutil
import socket as pysocket
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import anyio
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import AiosyncError, ErrorMap, PeerGoneError, map_exceptions
from aiosync.private_dirs import make_private_dir

log = logging.getLogger(__name__)

PEER_QUEUE = 256
"""Messages buffered per peer of a listener; beyond that a peer's messages are dropped."""

PEER_SEND_HWM = 256
"""Replies a listener queues per peer; a peer that lets more pile up is dropped."""

DROPPED_MEMORY = 4096
"""How many dropped peers' routing ids a listener remembers (their messages are ignored)."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (RFC 27)
ZAP_DOMAIN = b"aiosync"

_LOCAL_SCHEMES = ("ipc", "inproc")
_NETWORK_SCHEMES = ("tcp", "ws", "wss", "tipc", "vmci", "udp", "pgm", "epgm", "norm")
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_peer_numbers = itertools.count(1)


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


class _Throttled:
    """A warning logged at most once per ``every`` seconds, with a count of those held back.

    Peers decide how often these happen; a flood of them must not flood the log.
    """

    def __init__(self, message: str, every: float = 10.0) -> None:
        self._message = message
        self._every = every
        self._next = 0.0
        self._held = 0

    def __call__(self, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            log.warning(self._message + " (and %d more since the last report)", *args, self._held)
        else:
            log.warning(self._message, *args)
        self._next = now + self._every
        self._held = 0


# --- who may use which endpoint --------------------------------------------------------------


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ``tcp://`` on 127.0.0.0/8, ``::1`` or ``localhost``; anything unclear is not."""
    if not endpoint.startswith("tcp://"):
        return False
    address = endpoint.removeprefix("tcp://").rpartition(";")[2]  # "source;destination"
    host = address.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", interface names, host names: not provably loopback


def _wants_ipv6(endpoint: str) -> bool:
    """True for a ``tcp://`` endpoint with a bracketed (IPv6) address, which zmq needs told."""
    return endpoint.startswith("tcp://") and "[" in endpoint


def curve_keys(endpoint: str, auth: ChannelAuth | None, *, binding: bool) -> ChannelAuth | None:
    """The keys ``endpoint`` is used with (None: plain), or AiosyncError if it may not be.

    Keys given are always used, on any transport. Without keys: ``ipc://`` (and
    ``inproc://``) are allowed; ``tcp://`` only on a loopback address and only with
    ``insecure_loopback``; other network transports never. Unknown schemes are left to zmq,
    which refuses them as bad addresses.
    """
    if auth is not None and auth.has_keys:
        role = "bind" if binding else "connect to"
        try:
            auth.server_keys() if binding else auth.client_keys()
        except AiosyncError as exc:
            raise AiosyncError(f"cannot {role} {endpoint} with CURVE: {exc.reason}") from None
        return auth
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
    if scheme in _LOCAL_SCHEMES or scheme not in _NETWORK_SCHEMES:
        return None
    insecure = auth is not None and auth.insecure_loopback
    if scheme == "tcp" and insecure and is_loopback_endpoint(endpoint):
        log.warning("plain tcp on %s: any local user can connect (insecure_loopback)", endpoint)
        return None
    if scheme == "tcp" and insecure:
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


# --- one peer ------------------------------------------------------------------------------


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
        self._failure: AiosyncError | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        self._poller.register(socket, zmq.POLLIN)
        if context is not None:  # only watch sockets this channel owns
            events = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES
            self._monitor = socket.get_monitor_socket(events)
            self._poller.register(self._monitor, zmq.POLLIN)
        self._errors = _zmq_error(endpoint)

    @classmethod
    def connect(cls, endpoint: str, *, auth: ChannelAuth | None = None) -> ZmqChannel:
        """Connect a new DEALER socket, in a context of its own, to ``endpoint``.

        ``auth`` holds this side's keypair and the server's public key (CURVE), or allows
        plain tcp on loopback; ``tcp://`` without either is an AiosyncError.
        """
        keys = curve_keys(endpoint, auth, binding=False)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(_wants_ipv6(endpoint)))
        try:
            if keys is not None:
                public, secret, server = keys.client_keys()
                sock.setsockopt(zmq.CURVE_SERVERKEY, server)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            with map_exceptions(_zmq_error(endpoint)):
                sock.connect(endpoint)
        except BaseException:
            sock.close(linger=0)
            ctx.term()
            raise
        return cls(sock, endpoint=endpoint, context=ctx)

    @classmethod
    def wrap(cls, socket: zmq.Socket[bytes]) -> ZmqChannel:
        """Drive a caller's (blocking) REQ or DEALER socket from asyncio; not closed here.

        The caller's socket keeps the caller's security settings; none are checked here.
        """
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
        """Set when the connection to the peer drops or its handshake fails (seen in recv)."""
        return self._lost

    async def send(self, payload: bytes) -> None:
        """Send one message (REQ sockets add their own empty delimiter)."""
        with map_exceptions(self._errors):
            await self._socket.send(payload)

    async def recv(self) -> bytes:
        """The next message; :class:`PeerGoneError` as soon as the connection drops.

        A refused handshake (a key the server does not allow, a wrong server key, keys on
        one side only) is an :class:`AiosyncError` saying so, as soon as it happens.
        """
        with map_exceptions(self._errors):
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._lost.is_set():
                    raise PeerGoneError("peer disconnected", peer=self._endpoint)
                ready = dict(await self._poller.poll())
                if self._monitor is not None and self._monitor in ready:
                    self._watch(parse_monitor_message(await self._monitor.recv_multipart()))
                    continue
                if self._socket in ready:
                    frames = await self._socket.recv_multipart()
                    return bytes(frames[-1])

    def _watch(self, event: Mapping[str, object]) -> None:
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._failure = AiosyncError(
                f"refused by {self._endpoint}: it does not allow this side's CURVE key "
                f"(status {event['value']})",
                peer=self._endpoint,
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failure = AiosyncError(
                f"security handshake with {self._endpoint} failed: CURVE keys on one side "
                "only, or a peer that does not speak ZMTP",
                peer=self._endpoint,
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the peer just hung up
            self._failure = PeerGoneError(
                f"security handshake with {self._endpoint} failed: a wrong server key, or the "
                "peer closed during the handshake",
                peer=self._endpoint,
            )
        elif kind != zmq.EVENT_DISCONNECTED:
            return
        self._lost.set()

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


# --- many peers --------------------------------------------------------------------------


class RouterPeer:
    """One peer of a :class:`ZmqListener`: replies go out through the shared ROUTER."""

    def __init__(
        self, listener: ZmqListener, identity: bytes, *, delimited: bool, name: str
    ) -> None:
        self._listener = listener
        self.identity = identity  # the ZMQ routing id: for addressing only, never shown
        self.envelope = (identity, b"") if delimited else (identity,)
        self._peer = name
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](PEER_QUEUE)
        self._lost = anyio.Event()
        self._dropped = False
        self._overflow = _Throttled("%s sends faster than it is served; messages dropped")

    @property
    def peer(self) -> str:
        """``peer-<n>``, numbered by the listener (unique in this process)."""
        return self._peer

    @property
    def window(self) -> int | None:
        """No limit."""
        return None

    @property
    def lost(self) -> anyio.Event:
        """Set when a reply finds the peer gone, or the peer was dropped for not reading."""
        return self._lost

    def deliver(self, payload: bytes) -> None:
        """Queue a message from the peer; dropped (and logged) when the queue is full."""
        try:
            self._tx.send_nowait(payload)
        except anyio.WouldBlock:
            self._overflow(self._peer)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    def end(self, *, dropped: bool) -> None:
        """Mark the peer lost; ``dropped``: also discard what it sent and is not yet read."""
        self._dropped = self._dropped or dropped
        self._lost.set()
        self._tx.close()  # a pending recv wakes up

    async def send(self, payload: bytes) -> None:
        """Reply without waiting; :class:`PeerGoneError` if the peer left or was dropped."""
        if self._lost.is_set():
            raise PeerGoneError("peer is gone", peer=self._peer)
        await self._listener.send_to(self, payload)

    async def recv(self) -> bytes:
        """The next message the listener's accept loop delivered."""
        if self._dropped:
            raise PeerGoneError("peer was dropped", peer=self._peer)
        try:
            return await self._rx.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise PeerGoneError("peer channel closed", peer=self._peer) from None

    async def aclose(self) -> None:
        """Forget the peer; a later message from the same identity makes a new channel."""
        self._listener.forget(self)
        self._tx.close()
        self._rx.close()


class ZmqListener:
    """A bound ROUTER socket; :meth:`accept` yields a :class:`RouterPeer` per new identity.

    ``auth`` gives the keypair and the allowed client keys (CURVE), or allows plain tcp on
    loopback; ``send_hwm`` bounds the replies queued per peer; ``max_message_bytes``, if
    given, makes libzmq disconnect a peer that sends a larger message.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        private_dir: Path | None = None,
        auth: ChannelAuth | None = None,
        send_hwm: int = PEER_SEND_HWM,
        max_message_bytes: int | None = None,
    ) -> None:
        self._private_dir = private_dir
        self._errors = _zmq_error(endpoint)
        self._closed = True  # until bound
        try:
            keys = curve_keys(endpoint, auth, binding=True)
            _refuse_live_ipc(endpoint)
        except BaseException:
            self._remove_private_dir()
            raise
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._zap: zmq.asyncio.Socket | None = None
        self._allowed: frozenset[bytes] = frozenset()
        self._peers: dict[bytes, RouterPeer] = {}
        self._dropped: OrderedDict[bytes, None] = OrderedDict()
        self._poller = zmq.asyncio.Poller()
        self._hwm = send_hwm
        self._bad_frames = _Throttled("dropping a message of %d frames")
        self._not_reading = _Throttled("%s does not read its replies (%d queued): dropped it")
        self._refused = _Throttled("refused a %s client from %s (key %s is not allowed)")
        try:
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._socket.setsockopt(zmq.SNDHWM, send_hwm)
            self._socket.setsockopt(zmq.IPV6, int(_wants_ipv6(endpoint)))
            if max_message_bytes is not None:
                self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if keys is not None:
                self._serve_curve(keys)
            with map_exceptions(self._errors):
                self._socket.bind(endpoint)
        except BaseException:
            self._socket.close(linger=0)
            if self._zap is not None:
                self._zap.close(linger=0)
            self._ctx.term()
            self._remove_private_dir()
            raise
        self._poller.register(self._socket, zmq.POLLIN)
        self._endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    def _serve_curve(self, keys: ChannelAuth) -> None:
        """Make the ROUTER a CURVE server whose ZAP handler (answered in accept) is bound first.

        libzmq lets every client key in when no ZAP handler is bound, so the handler lives
        in this listener's own context, from before the bind until after the close.
        """
        public, secret, allowed = keys.server_keys()
        self._allowed = allowed
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._poller.register(self._zap, zmq.POLLIN)
        self._socket.setsockopt(zmq.CURVE_SERVER, 1)
        self._socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self._socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self._socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    @classmethod
    def open(
        cls,
        endpoint: str | None = None,
        *,
        auth: ChannelAuth | None = None,
        max_message_bytes: int | None = None,
    ) -> ZmqListener:
        """Bind ``endpoint``, or ``ipc://`` in a new private directory (removed on close)."""
        if endpoint is not None:
            return cls(endpoint, auth=auth, max_message_bytes=max_message_bytes)
        endpoint, directory = private_ipc_endpoint()
        return cls(endpoint, private_dir=directory, auth=auth, max_message_bytes=max_message_bytes)

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    @property
    def endpoint(self) -> str:
        """The bound address (with the port chosen for ``tcp://...:0``)."""
        return self._endpoint

    @property
    def curve(self) -> bool:
        """True when peers must authenticate with an allowed CURVE key."""
        return self._zap is not None

    async def accept(self) -> RouterPeer:
        """Deliver messages to known peers until one arrives from a new identity.

        Also answers libzmq's authentication requests when keys are in use, so handshakes
        complete only while some task is accepting.
        """
        with map_exceptions(self._errors):
            while True:
                if self._zap is not None:
                    ready = dict(await self._poller.poll())
                    if self._zap in ready:
                        await self._answer_zap()
                    if self._socket not in ready:
                        continue
                frames = await self._socket.recv_multipart()
                # [identity, payload] from a DEALER; [identity, b"", payload] from a REQ
                delimited = len(frames) == 3 and not frames[1]
                if len(frames) != 2 and not delimited:
                    self._bad_frames(len(frames))
                    continue
                identity, payload = bytes(frames[0]), bytes(frames[-1])
                if identity in self._dropped:
                    continue  # its replies still fill its queue: ignore it
                known = self._peers.get(identity)
                if known is not None:
                    known.deliver(payload)
                    continue
                name = f"peer-{next(_peer_numbers)}"
                peer = RouterPeer(self, identity, delimited=delimited, name=name)
                self._peers[identity] = peer
                peer.deliver(payload)
                return peer

    async def _answer_zap(self) -> None:
        """Answer every pending ZAP request: only allowed CURVE client keys get in."""
        assert self._zap is not None
        with anyio.CancelScope(shield=True):  # a REP must answer what it received
            while True:
                try:
                    request = await self._zap.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    return
                await self._zap.send_multipart(self._zap_reply(request), flags=zmq.NOBLOCK)

    def _zap_reply(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:  # libzmq itself asks; it never sends less
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"bad", b"", b""]
        version, request_id, domain, address, _, mechanism, *credentials = request
        key = b""
        if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            key = z85.encode(credentials[0])
        if version == b"1.0" and domain == ZAP_DOMAIN and key in self._allowed:
            return [b"1.0", request_id, b"200", b"OK", key, b""]
        self._refused(
            mechanism.decode("ascii", "replace")[:16],
            address.decode("ascii", "replace")[:64],
            key.decode("ascii") or "-",
        )
        return [b"1.0", request_id, b"400", b"key not allowed", b"", b""]

    async def send_to(self, peer: RouterPeer, payload: bytes) -> None:
        """Send to one peer without waiting; drop it if its queue of replies is full.

        :class:`PeerGoneError` when the peer has disconnected or was just dropped (the
        reply is then discarded); any other ZMQ error is an :class:`AiosyncError`.
        """
        try:
            await self._socket.send_multipart([*peer.envelope, payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop(peer, reason="not reading")
            self._not_reading(peer.peer, self._hwm)
            raise PeerGoneError("peer does not read its replies; dropped", peer=peer.peer) from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._drop(peer, reason=None)
                raise PeerGoneError("peer disconnected", peer=peer.peer) from None
            with map_exceptions(self._errors):
                raise

    def _drop(self, peer: RouterPeer, *, reason: str | None) -> None:
        """Forget a peer; with a ``reason``, also ignore its routing id from now on."""
        peer.end(dropped=reason is not None)
        self.forget(peer)
        if reason is not None:
            self._dropped[peer.identity] = None
            while len(self._dropped) > DROPPED_MEMORY:
                self._dropped.popitem(last=False)

    def forget(self, peer: RouterPeer) -> None:
        """Drop a peer's channel (its next message starts a new one)."""
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]

    async def aclose(self) -> None:
        """Close the sockets and context, and remove an ``ipc://`` socket file."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            await peer.aclose()
        self._socket.close(linger=0)
        if self._zap is not None:  # after the ROUTER: no handler means no check at all
            self._zap.close(linger=0)
        self._ctx.term()
        path = _ipc_path(self._endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
        self._remove_private_dir()
