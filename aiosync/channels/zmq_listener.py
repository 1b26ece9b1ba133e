"""The ROUTER side of the ZMQ channels: :class:`ZmqListener` (its peers: :mod:`.zmq_peer`).

:class:`ZmqListener` binds a ROUTER and yields a channel per peer identity; its
:meth:`~ZmqListener.accept` loop is also what delivers every peer's messages (and answers
CURVE authentication requests through ZAP, RFC 27), so whoever owns a listener keeps one
task accepting. A listener with keys lets in only the client keys it lists: a peer without
one never gets a message through, and each peer's channel knows the key it came with
(:attr:`RouterPeer.key`; a message from its routing id under another key is ignored).

A listener may also *connect* its ROUTER to an address a peer binds
(:meth:`ZmqListener.connect_to`): NeMo-RL's policy worker binds its REQ socket and the engine
connects. Its channels and rules are the same; only the socket's direction differs.

A listener never waits on a peer: replies go out without blocking, each peer may have at
most ``send_hwm`` replies queued, and a peer that lets its queue fill (it does not read) is
dropped with its reply. Peers are named ``peer-1``, ``peer-2``, ... by the listener, never by
their ZMQ routing ids, which a peer may choose.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import zmq
import zmq.asyncio
from zmq.utils import z85

from aiosync.channels.endpoints import check_endpoint
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.unix_listeners import refuse_double_bind
from aiosync.channels.zmq_common import (
    CLOSE_LINGER_MS,
    curve_keys,
    ipc_path,
    private_ipc_endpoint,
    refuse_live_ipc,
    wants_ipv6,
    zmq_error,
)
from aiosync.channels.zmq_owned import OwnedSockets, PrivateContext
from aiosync.channels.zmq_peer import PEER_QUEUE as PEER_QUEUE
from aiosync.channels.zmq_peer import RouterPeer as RouterPeer
from aiosync.channels.zmq_peer import Throttled
from aiosync.core.errors import PeerGoneError, UsageError, map_exceptions

QUEUED_MESSAGES = 2
"""Largest messages' worth of bytes a peer may have held by a listener (queued, or read and
not yet served); beyond that its messages are dropped."""

PEER_SEND_HWM = 256
"""Replies a listener queues per peer; a peer that lets more pile up is dropped."""

DROPPED_MEMORY = 4096
"""How many dropped peers' routing ids a listener remembers (their messages are ignored)."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (RFC 27)
ZAP_DOMAIN = b"aiosync"

_peer_numbers = itertools.count(1)


def _remover(path: Path | None, directory: Path | None) -> Callable[[], None]:
    """What a dropped listener removes once closed: its socket file and private directory."""

    def remove() -> None:
        if path is not None:
            path.unlink(missing_ok=True)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    return remove


class ZmqListener:
    """A bound ROUTER socket; :meth:`accept` yields a :class:`RouterPeer` per new identity.

    ``auth`` gives the keypair and the allowed client keys (CURVE), or allows plain tcp on
    loopback; ``send_hwm`` bounds the replies queued per peer; ``max_message_bytes``, if
    given, makes libzmq disconnect a peer that sends a larger message, and holds each peer to
    ``QUEUED_MESSAGES`` such messages' bytes not yet served. ``connecting``:
    connect the ROUTER to ``endpoint``, which a peer binds, instead of binding it (the
    listener then stays the CURVE server, and its closing leaves the peer's socket file).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        private_dir: Path | None = None,
        auth: ChannelAuth | None = None,
        send_hwm: int = PEER_SEND_HWM,
        max_message_bytes: int | None = None,
        connecting: bool = False,
    ) -> None:
        self._private_dir = private_dir
        self._connecting = connecting
        self._errors = zmq_error(endpoint)
        self._closed = True  # until bound
        try:
            check_endpoint(endpoint, binding=True)
            keys = curve_keys(endpoint, auth, binding=True)
            (refuse_double_bind if connecting else refuse_live_ipc)(endpoint)
        except BaseException:
            self._remove_private_dir()
            raise
        self._ctx = PrivateContext()
        self._socket = self._ctx.socket(zmq.ROUTER)
        most = max_message_bytes
        self._peer_bytes = None if most is None else QUEUED_MESSAGES * most
        self._zap: zmq.asyncio.Socket | None = None
        self._allowed: frozenset[bytes] = frozenset()
        self._peers: dict[bytes, RouterPeer] = {}
        self._dropped: OrderedDict[bytes, None] = OrderedDict()
        self._poller = zmq.asyncio.Poller()
        self._hwm = send_hwm
        self._bad_frames = Throttled("dropping a message of %d frames")
        self._not_reading = Throttled("%s does not read its replies (%d queued): dropped it")
        self._refused = Throttled("refused a %s client from %s (key %s is not allowed)")
        try:
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._socket.setsockopt(zmq.SNDHWM, send_hwm)
            self._socket.setsockopt(zmq.IPV6, int(wants_ipv6(endpoint)))
            if max_message_bytes is not None:
                self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if keys is not None:
                self._serve_curve(keys)
            with map_exceptions(self._errors):
                (self._socket.connect if connecting else self._socket.bind)(endpoint)
        except BaseException:
            self._socket.close(linger=0)
            if self._zap is not None:
                self._zap.close(linger=0)
            self._ctx.term()
            self._remove_private_dir()
            raise
        self._poller.register(self._socket, zmq.POLLIN)
        self._endpoint = (
            endpoint if connecting else self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._closed = False
        files = None if connecting else ipc_path(self._endpoint)
        self._owned = OwnedSockets(self._ctx, cleanup=_remover(files, self._private_dir))
        self._owned.add(self._socket, flush=True)
        if self._zap is not None:  # after the ROUTER: no handler means no check at all
            self._owned.add(self._zap, flush=False)
        self._owned.watch(self)  # dropped without aclose: closed, never hung

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
        connect: str | None = None,
    ) -> ZmqListener:
        """Bind ``endpoint``, or ``ipc://`` in a new private directory (removed on close).

        With ``connect`` (and no ``endpoint``), connect to that address instead: see
        :meth:`connect_to`.
        """
        if connect is not None:
            if endpoint is not None:
                raise UsageError(f"bind {endpoint} or connect to {connect}, not both")
            return cls.connect_to(connect, auth=auth, max_message_bytes=max_message_bytes)
        if endpoint is not None:
            return cls(endpoint, auth=auth, max_message_bytes=max_message_bytes)
        endpoint, directory = private_ipc_endpoint()
        return cls(endpoint, private_dir=directory, auth=auth, max_message_bytes=max_message_bytes)

    @classmethod
    def connect_to(
        cls,
        endpoint: str,
        *,
        auth: ChannelAuth | None = None,
        max_message_bytes: int | None = None,
    ) -> ZmqListener:
        """Connect to ``endpoint``, bound by a peer (a trainer's REQ socket), and serve it.

        ZMQ connects in the background and again after the peer rebinds, so the peer may
        bind before or after this call. An ``ipc://`` path that two live sockets bound
        (one displaced the other) is refused at once, naming it.
        """
        return cls(endpoint, auth=auth, max_message_bytes=max_message_bytes, connecting=True)

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    @property
    def endpoint(self) -> str:
        """The bound address (with the port chosen for ``tcp://...:0``), or the connected one."""
        return self._endpoint

    @property
    def queued_bytes(self) -> int:
        """Bytes its peers' messages hold here, not yet served (:attr:`RouterPeer.queued_bytes`)."""
        return sum(peer.queued_bytes for peer in self._peers.values())

    @property
    def curve(self) -> bool:
        """True when peers must authenticate with an allowed CURVE key."""
        return self._zap is not None

    async def accept(self) -> RouterPeer:
        """Deliver messages to known peers until one arrives from a new identity.

        Also answers libzmq's authentication requests when keys are in use, so handshakes
        complete only while some task is accepting.
        """
        self._owned.loop = asyncio.get_running_loop()  # where a dropped listener is closed
        with map_exceptions(self._errors):
            while True:
                if self._zap is not None:
                    ready = dict(await self._poller.poll())
                    if self._zap in ready:
                        await self._answer_zap()
                    if self._socket not in ready:
                        continue
                received = await self._socket.recv_multipart(copy=self._zap is None)
                key = self._key_of(received[-1])
                frames = [f.bytes if isinstance(f, zmq.Frame) else f for f in received]
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
                    if known.key == key:  # a routing id taken over by another key: ignored
                        known.deliver(payload)
                    continue
                name = f"peer-{next(_peer_numbers)}"
                peer = RouterPeer(
                    self,
                    identity,
                    delimited=delimited,
                    name=name,
                    key=key,
                    max_bytes=self._peer_bytes,
                )
                self._peers[identity] = peer
                peer.deliver(payload)
                return peer

    def _key_of(self, frame: bytes | zmq.Frame) -> bytes | None:
        """The CURVE key a message came with: the user id this listener's ZAP reply gave."""
        if self._zap is None or not isinstance(frame, zmq.Frame):
            return None
        return str(frame.get("User-Id")).encode("ascii", "replace")

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
        await self._send(peer, [payload], copy=True)

    async def send_parts_to(
        self, peer: RouterPeer, parts: Sequence[bytes | memoryview]
    ) -> zmq.MessageTracker:
        """As :meth:`send_to`, one message of several parts, none copied.

        The returned tracker is ``done`` once libzmq no longer reads the parts' memory.
        """
        tracker = await self._send(peer, parts, copy=False)
        assert tracker is not None  # a zero-copy send is tracked
        return tracker

    async def _send(
        self, peer: RouterPeer, parts: Sequence[bytes | memoryview], *, copy: bool
    ) -> zmq.MessageTracker | None:
        message = [*peer.envelope, *parts]
        try:
            sent = self._socket.send_multipart(
                message, flags=zmq.NOBLOCK, copy=copy, track=not copy
            )
            tracker: zmq.MessageTracker | None = await sent
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
        return tracker

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
        self._owned.close(CLOSE_LINGER_MS)
        path = ipc_path(self._endpoint)
        if path is not None and not self._connecting:  # a connected path is the peer's
            path.unlink(missing_ok=True)
        self._remove_private_dir()
