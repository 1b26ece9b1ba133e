"""ZMQ control channel: small msgpack messages between a sender and its receivers.

The receiver binds a ROUTER socket and so can serve several senders, telling them apart by
identity; a sender connects a DEALER (any number of messages in flight) or, for drop-in
use, hands in its own REQ socket (one in flight). Tensor bytes never travel here: they stay
in shared buffers and messages only name them.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aiosync.errors import PeerGoneError

log = logging.getLogger(__name__)


def private_ipc_endpoint(name: str = "engine") -> tuple[str, Path]:
    """A fresh ``ipc://`` endpoint inside a new directory only this user can enter.

    Returns the endpoint and the directory, which the caller removes when done.
    """
    directory = Path(tempfile.mkdtemp(prefix="aiosync-"))
    return f"ipc://{directory / (name + '.sock')}", directory


class SenderChannel:
    """The sender's end: sends requests to one receiver and reads its replies in order."""

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        *,
        endpoint: str,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.socket = socket
        self.endpoint = endpoint
        self._context = context
        self.max_in_flight: int | None = 1 if socket.type == zmq.REQ else None
        self._monitor: zmq.asyncio.Socket | None = None
        if context is not None:  # only watch sockets this channel owns
            self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    @classmethod
    def connect(cls, endpoint: str) -> SenderChannel:
        """Connect a new DEALER socket, in a context of its own, to ``endpoint``."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            ctx.term()
            raise
        return cls(sock, endpoint=endpoint, context=ctx)

    @classmethod
    def wrap(cls, socket: zmq.Socket[bytes]) -> SenderChannel:
        """Drive a caller's (blocking) REQ, DEALER or PAIR socket from asyncio; not closed here."""
        if socket.type not in (zmq.REQ, zmq.DEALER, zmq.PAIR):
            raise ValueError("the sender needs a REQ, DEALER or PAIR socket")
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT) or "<caller's socket>"
        shadow = zmq.asyncio.Socket.shadow(socket.underlying)
        return cls(shadow, endpoint=endpoint)

    async def send(self, payload: bytes) -> None:
        """Send one message (REQ sockets add their own empty delimiter)."""
        await self.socket.send(payload)

    async def recv(self) -> bytes:
        """Receive one reply, whatever the socket type."""
        frames = await self.socket.recv_multipart()
        return bytes(frames[-1])

    async def wait_disconnected(self) -> None:
        """Return once the connection to the receiver drops (never, for a caller's socket).

        The kernel closes the socket of a process that dies, so this fires at once when
        the receiver is killed, well before any ack timeout.
        """
        if self._monitor is None:
            await anyio.sleep_forever()
            return
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return

    def close(self) -> None:
        """Close socket and context if this channel created them (pending messages dropped)."""
        if self._context is not None:
            if self._monitor is not None:
                self.socket.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self.socket.close(linger=0)
            self._context.term()
            self._context = None

    async def __aenter__(self) -> SenderChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ReceiverChannel:
    """The receiver's end: a bound ROUTER socket; each message comes with its reply envelope."""

    def __init__(self, endpoint: str | None = None) -> None:
        self._cleanup_dir: Path | None = None
        if endpoint is None:
            endpoint, self._cleanup_dir = private_ipc_endpoint()
        self._ctx = zmq.asyncio.Context()
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[list[bytes], bytes]:
        """Next message as (envelope, payload); the envelope routes the reply back."""
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) >= 2:
                return [bytes(f) for f in frames[:-1]], bytes(frames[-1])
            log.warning("dropping a message without an envelope")

    async def send(self, envelope: list[bytes], payload: bytes) -> None:
        """Reply along ``envelope``; :class:`PeerGoneError` if that peer has disconnected."""
        try:
            await self.socket.send_multipart([*envelope, payload])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGoneError("peer disconnected before the reply") from None
            raise

    def close(self) -> None:
        """Close the socket and context, and remove the private ipc directory if made here."""
        self.socket.close(linger=0)
        self._ctx.term()
        if self._cleanup_dir is not None:
            shutil.rmtree(self._cleanup_dir, ignore_errors=True)
            self._cleanup_dir = None
