"""ZMQ control channels: a DEALER (or a caller's REQ) to one peer, a ROUTER for many.

This module holds :class:`ZmqChannel`, the connecting side. It connects to one peer; its
:meth:`~ZmqChannel.recv` also watches the connection, so a peer process that dies (during
the hello as during a stream) is noticed at once rather than after a timeout. A channel is
driven from one event loop at a time and may move to another once the first stops running;
dropped without :meth:`~ZmqChannel.aclose`, it closes its sockets on its own
(:mod:`aiosync.channels.zmq_owned` says how that never hangs). The ROUTER
side (:class:`ZmqListener`, :class:`RouterPeer`) lives in
:mod:`aiosync.channels.zmq_listener`, the endpoint and security rules shared by both in
:mod:`aiosync.channels.zmq_common`; both are re-exported here, so importers need only
this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aiosync.channels.endpoints import check_endpoint, is_loopback_endpoint
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.zmq_common import (
    CLOSE_LINGER_MS,
    curve_keys,
    private_ipc_endpoint,
    wants_ipv6,
    zmq_error,
)
from aiosync.channels.zmq_listener import (
    DROPPED_MEMORY,
    PEER_QUEUE,
    PEER_SEND_HWM,
    ZAP_DOMAIN,
    ZAP_ENDPOINT,
    RouterPeer,
    ZmqListener,
)
from aiosync.channels.zmq_owned import OwnedSockets, PrivateContext
from aiosync.core.errors import AiosyncError, PeerGoneError, UsageError, map_exceptions

__all__ = [
    "DROPPED_MEMORY",
    "PEER_QUEUE",
    "PEER_SEND_HWM",
    "ZAP_DOMAIN",
    "ZAP_ENDPOINT",
    "RouterPeer",
    "ZmqChannel",
    "ZmqListener",
    "curve_keys",
    "is_loopback_endpoint",
    "private_ipc_endpoint",
]

_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class ZmqChannel:
    """A connection to one peer through a DEALER socket, or through a caller's socket.

    A REQ socket allows one message awaiting its reply (``window`` 1) and no unasked
    messages; after a failure its state is unknown and the caller must replace it.

    pyzmq registers a socket with the event loop that uses it, and a socket watched by two
    running loops is read from two threads; so using the channel from a second loop while
    the first still runs is a :class:`~aiosync.core.errors.UsageError` (a
    :class:`~aiosync.handles.ChannelHandle` opens a channel per loop instead).
    """

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        *,
        endpoint: str,
        context: PrivateContext | None = None,
    ) -> None:
        self._socket = socket
        self._endpoint = endpoint
        self._owned: OwnedSockets | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._window = 1 if socket.type == zmq.REQ else None
        self._lost = anyio.Event()
        self._failure: AiosyncError | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        self._poller.register(socket, zmq.POLLIN)
        if context is not None:  # only watch and close sockets this channel owns
            self._owned = OwnedSockets(context)
            events = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES
            self._monitor = socket.get_monitor_socket(events)
            self._owned.add(self._monitor, flush=False)
            self._owned.add(socket, flush=True)
            self._poller.register(self._monitor, zmq.POLLIN)
            self._owned.watch(self)
        self._errors = zmq_error(endpoint)

    @classmethod
    def connect(
        cls,
        endpoint: str,
        *,
        auth: ChannelAuth | None = None,
        max_message_bytes: int | None = None,
    ) -> ZmqChannel:
        """Connect a new DEALER socket, in a context of its own, to ``endpoint``.

        ``max_message_bytes``: libzmq drops the connection (never buffering it) when the
        peer sends a larger frame, each part of a message counted alone.

        ``auth`` holds this side's keypair and the server's public key (CURVE), or allows
        plain tcp on loopback; ``tcp://`` without either is an AiosyncError, and so is an
        endpoint without a scheme or on ``inproc://`` (:func:`~aiosync.channels.endpoints.
        check_endpoint`).
        """
        check_endpoint(endpoint, binding=False)
        keys = curve_keys(endpoint, auth, binding=False)
        ctx = PrivateContext()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(wants_ipv6(endpoint)))
        if max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        channel: ZmqChannel | None = None
        try:
            if keys is not None:
                public, secret, server = keys.client_keys()
                sock.setsockopt(zmq.CURVE_SERVERKEY, server)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            # The channel attaches its monitor first: a handshake that fails at once is seen.
            channel = cls(sock, endpoint=endpoint, context=ctx)
            with map_exceptions(zmq_error(endpoint)):
                sock.connect(endpoint)
        except BaseException:
            if channel is not None and channel._owned is not None:
                sock.disable_monitor()
                channel._owned.close(0)
            else:
                sock.close(linger=0)
                ctx.term()
            raise
        return channel

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
    def key(self) -> bytes | None:
        """None: this side connected, so the peer is the bound side, known by its address."""
        return None

    @property
    def window(self) -> int | None:
        """1 for a REQ socket, else None."""
        return self._window

    @property
    def lost(self) -> anyio.Event:
        """Set when the connection to the peer drops or its handshake fails (seen in recv)."""
        return self._lost

    def _on_this_loop(self) -> None:
        """Bind to the running loop; refuse a second loop while the first still runs."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None and self._loop.is_running():
            raise UsageError(
                "this ZMQ channel is in use on another event loop that is still running; "
                "drive a channel from one loop at a time",
                peer=self._endpoint,
            )
        self._loop = loop
        if self._owned is not None:
            self._owned.loop = loop

    async def send(self, payload: bytes) -> None:
        """Send one message (REQ sockets add their own empty delimiter)."""
        self._on_this_loop()
        with map_exceptions(self._errors):
            await self._socket.send(payload)

    async def send_parts(self, parts: Sequence[bytes | memoryview]) -> zmq.MessageTracker:
        """Send one message of several parts without copying them.

        The tracker is ``done`` once libzmq no longer reads the parts' memory.
        """
        self._on_this_loop()
        with map_exceptions(self._errors):
            tracker = await self._socket.send_multipart(list(parts), copy=False, track=True)
        assert tracker is not None  # a tracked send
        return tracker

    async def recv(self) -> bytes:
        """The next message; :class:`PeerGoneError` as soon as the connection drops.

        A refused handshake (a key the server does not allow, a wrong server key, keys on
        one side only) is an :class:`AiosyncError` saying so, as soon as it happens. A
        message already waiting is taken without polling (about 80 µs less per message:
        acks of pipelined messages are often there already); the socket's monitor is
        read whenever none is. Of a message of several parts, the last.
        """
        return bytes((await self._frames(copy=True))[-1])

    async def recv_parts(self) -> list[memoryview]:
        """The next message's parts as views of libzmq's buffers, not copied (as :meth:`recv`)."""
        return [frame.buffer for frame in await self._frames(copy=False)]

    async def _frames(self, *, copy: bool) -> list[Any]:
        self._on_this_loop()
        with map_exceptions(self._errors):
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._lost.is_set():
                    try:  # what the peer sent before it left (its last ack) still counts
                        return await self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
                    except zmq.Again:
                        raise PeerGoneError("peer disconnected", peer=self._endpoint) from None
                if self._window is None:  # a DEALER: a message already waiting needs no poll
                    try:
                        return await self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
                    except zmq.Again:
                        pass
                ready = dict(await self._poller.poll())
                if self._socket in ready:
                    return await self._socket.recv_multipart(copy=copy)
                if self._monitor is not None and self._monitor in ready:
                    self._watch(parse_monitor_message(await self._monitor.recv_multipart()))

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
        """Close socket and context if this channel made them (idempotent).

        What the socket still has queued may go out for up to ``CLOSE_LINGER_MS``.
        """
        if self._owned is None or self._owned.closed:
            return
        self._socket.disable_monitor()
        self._owned.close(CLOSE_LINGER_MS)
