"""The engine's side: a receiver that serves weight streams into a sink from the event loop.

Embed it in an async rollout loop::

    async with WeightReceiver(ModuleSink(model), endpoint) as receiver:
        while True:
            await generate(model)            # receiver applies new versions meanwhile
            print(receiver.current_version)

``current_version`` changes only when a sender's COMPLETE has been checked and committed.
A broken stream (rejected bucket, sender gone silent, abort) leaves it where it was; with an
in-place sink the engine is then marked not servable until the next successful commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import anyio
import anyio.abc

from aiosync.errors import AiosyncError, MismatchError, ProtocolError, SyncTimeoutError
from aiosync.layout import spec_bytes
from aiosync.memory import SharedBuffer, ShmSegment, open_buffer
from aiosync.protocol import Phase, ReceiverProtocol, SequenceError
from aiosync.sinks import WeightSink
from aiosync.transports.zmq import ReceiverChannel
from aiosync.wire import (
    GOODBYE_SEQ,
    Abort,
    Ack,
    Bucket,
    Complete,
    Goodbye,
    Hello,
    Message,
    Ping,
    decode,
    encode,
)

log = logging.getLogger(__name__)

IDLE_POLL = 1.0  # seconds between housekeeping checks while no deadline is nearer


@dataclass(frozen=True)
class ReceiverConfig:
    """Timeouts of a receiver, in seconds.

    ``stream_timeout``: the longest a sender may go without a bucket or commit in the middle
    of a version before the stream is dropped. ``session_timeout``: the longest a session
    may go without any message (senders send keepalives while idle) before it is closed and
    its buffers unmapped. ``reply_timeout`` bounds sending one reply.
    """

    stream_timeout: float = 60.0
    session_timeout: float = 60.0
    reply_timeout: float = 10.0


@dataclass(frozen=True)
class SyncFailure:
    """A stream that did not commit: who sent it, which version, and why."""

    peer: str
    version: int | None
    reason: str


@dataclass
class _Session:
    peer: str
    protocol: ReceiverProtocol
    buffers: list[SharedBuffer] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)  # any message
    last_progress: float = field(default_factory=time.monotonic)  # a bucket or commit done

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()


class WeightReceiver:
    """Serves weight streams from any number of senders into one sink, one stream at a time.

    Binds ``endpoint`` (default: ``ipc://`` in a new private directory; read
    :attr:`endpoint` for the address to give senders). Use as ``async with``, entered and
    left in one task: the serving task lives inside the block and is cancelled, with every
    socket and buffer released, when it ends. While one sender streams, another's buckets
    are refused with a "busy" error it can retry after.
    """

    def __init__(
        self,
        sink: WeightSink,
        endpoint: str | None = None,
        *,
        config: ReceiverConfig | None = None,
        on_commit: Callable[[int], object] | None = None,
    ) -> None:
        self.sink = sink
        self.config = config or ReceiverConfig()
        self.current_version: int | None = None
        self.servable = True
        self.failures: list[SyncFailure] = []
        self.protocol_errors = 0
        self._requested_endpoint = endpoint
        self._on_commit = on_commit
        self._channel: ReceiverChannel | None = None
        self._sessions: dict[bytes, _Session] = {}
        self._streaming: bytes | None = None
        self._limiter = anyio.CapacityLimiter(1)
        self._committed = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None

    @property
    def sessions(self) -> int:
        """Sender sessions open now (each holds its buffers mapped)."""
        return len(self._sessions)

    @property
    def endpoint(self) -> str:
        """The bound address senders connect to."""
        if self._channel is None:
            raise AiosyncError("receiver is not open")
        return self._channel.endpoint

    @property
    def last_failure(self) -> SyncFailure | None:
        """The most recent stream that failed, if any."""
        return self.failures[-1] if self.failures else None

    async def __aenter__(self) -> WeightReceiver:
        self._channel = ReceiverChannel(self._requested_endpoint)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self.serve_forever)
        log.info("receiving weights at %s", self.endpoint)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._task_group is not None:
                self._task_group.cancel_scope.cancel()
                await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._task_group = None
            for key in list(self._sessions):
                self._drop_session(key, "receiver closing")
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    async def wait_for_version(self, version: int, timeout: float) -> int:
        """Wait until ``current_version >= version``; :class:`SyncTimeoutError` after timeout."""
        deadline = time.monotonic() + timeout
        while self.current_version is None or self.current_version < version:
            remaining = deadline - time.monotonic()
            with anyio.move_on_after(max(remaining, 0)) as scope:
                await self._committed.wait()
            if scope.cancelled_caught:
                raise SyncTimeoutError(
                    f"still at version {self.current_version} after {timeout:g}s", version=version
                )
        return self.current_version

    async def serve_forever(self) -> None:
        """Receive and handle messages until cancelled (``async with`` runs this for you)."""
        channel = self._channel
        if channel is None:
            raise AiosyncError("receiver is not open")
        while True:
            got: tuple[list[bytes], bytes] | None = None
            with anyio.move_on_after(self._poll_interval()):
                got = await channel.recv()
            if got is not None:
                await self._handle(*got)
            self._expire_sessions()

    def _deadline(self, key: bytes, session: _Session) -> float:
        if key == self._streaming:
            return session.last_progress + self.config.stream_timeout
        return session.last_seen + self.config.session_timeout

    def _poll_interval(self) -> float:
        now = time.monotonic()
        nearest = min((self._deadline(k, s) for k, s in self._sessions.items()), default=now)
        return max(0.0, min(IDLE_POLL, nearest - now)) if self._sessions else IDLE_POLL

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for key, session in list(self._sessions.items()):
            if now < self._deadline(key, session):
                continue
            if key == self._streaming:
                stream = session.protocol.stream
                silent = now - session.last_progress
                reason = f"sender made no progress for {silent:.1f}s in mid-stream (silent)"
                self._record_failure(session.peer, stream.version if stream else None, reason)
            self._drop_session(key, "timed out")

    async def _reply(self, envelope: list[bytes], message: Message) -> None:
        assert self._channel is not None
        with anyio.move_on_after(self.config.reply_timeout) as scope:
            try:
                await self._channel.send(envelope, encode(message))
            except AiosyncError as exc:
                log.warning("could not reply %s: %s", type(message).__name__, exc)
        if scope.cancelled_caught:
            log.warning("reply %s timed out", type(message).__name__)

    async def _handle(self, envelope: list[bytes], payload: bytes) -> None:
        key = envelope[0]
        session = self._sessions.get(key)
        peer = session.peer if session else f"peer-{key.hex()}"
        try:
            message = decode(payload)
        except ProtocolError as exc:
            await self._protocol_error(envelope, ProtocolError(exc.reason, peer=peer))
            return
        if isinstance(message, Hello):
            await self._on_hello(envelope, message)
            return
        if session is None:
            if isinstance(message, Abort | Ping):  # nothing to abort or keep alive: no reply
                log.debug("%s from %s without a session ignored", type(message).__name__, peer)
                return
            error = SequenceError(f"{type(message).__name__.lower()} before hello", peer=peer)
            await self._protocol_error(envelope, error)
            return
        session.last_seen = time.monotonic()
        session.protocol.current_version = self.current_version
        try:
            if isinstance(message, Bucket):
                await self._on_bucket(key, session, envelope, message)
            elif isinstance(message, Complete):
                await self._on_complete(key, session, envelope, message)
            elif isinstance(message, Abort):
                session.protocol.abort(message)
                if self._streaming == key:  # not yet recorded as failed
                    reason = f"sender aborted: {message.reason}"
                    self._record_failure(session.peer, message.version, reason)
                self._end_stream(key)
            elif isinstance(message, Goodbye):
                stream = session.protocol.stream
                if self._streaming == key and stream is not None:
                    reason = "sender said goodbye in mid-stream"
                    self._record_failure(session.peer, stream.version, reason)
                session.protocol.goodbye(message)
                self._drop_session(key, "sender said goodbye")
                await self._reply(envelope, Ack(seq=GOODBYE_SEQ, ok=True))
            elif isinstance(message, Ping):
                pass  # last_seen is updated above
            else:
                raise ProtocolError(f"unexpected {type(message).__name__}", peer=peer)
        except ProtocolError as exc:
            await self._protocol_error(envelope, exc)

    async def _protocol_error(self, envelope: list[bytes], exc: ProtocolError) -> None:
        """Count the error, end the peer's session (the two sides disagree) and tell it why."""
        self.protocol_errors += 1
        log.warning("protocol error: %s", exc)
        key = envelope[0]
        if key in self._sessions:
            session = self._sessions[key]
            if self._streaming == key:
                stream = session.protocol.stream
                self._record_failure(session.peer, stream.version if stream else None, str(exc))
            self._drop_session(key, "protocol error")
        await self._reply(envelope, Abort(reason=str(exc)))

    async def _on_hello(self, envelope: list[bytes], message: Hello) -> None:
        key = envelope[0]
        if key in self._sessions:
            self._drop_session(key, "sender reconnected")
        peer = f"{message.sender}@{key.hex()}"
        protocol = ReceiverProtocol(peer, self.current_version)
        session = _Session(peer, protocol)
        device = self.sink.device
        try:
            ready = protocol.hello(message)
            for handle in message.buffers:
                session.buffers.append(
                    open_buffer(handle, device.index if device.type == "cuda" else None)
                )
        except Exception as exc:
            session.close()
            self.protocol_errors += 1
            log.warning("refused session from %s: %s", peer, exc)
            await self._reply(envelope, Abort(reason=f"session refused: {exc}"))
            return
        for buf in session.buffers:
            if isinstance(buf, ShmSegment):
                buf.unlink()  # mapped now; the name is no longer needed by anyone
        self._sessions[key] = session
        log.info("session from %s with %d buffers", peer, len(session.buffers))
        await self._reply(envelope, ready)

    async def _refuse_if_busy(
        self, key: bytes, session: _Session, envelope: list[bytes], message: Bucket | Complete
    ) -> bool:
        """Answer "busy" when another sender is streaming; the sequence number is used up."""
        if self._streaming in (None, key):
            return False
        session.protocol.take_seq(message.seq, message.version)
        other = self._sessions[self._streaming].peer
        error = f"{other} is streaming; try again later"
        await self._reply(envelope, Ack(seq=message.seq, ok=False, error=error))
        return True

    def _check_specs(self, session: _Session, message: Bucket) -> None:
        """Run the protocol's and the sink's checks; any failure becomes an AiosyncError."""
        session.protocol.check_bucket(message)
        for spec in message.specs:
            try:
                self.sink.check(spec)
            except AiosyncError:
                raise
            except Exception as exc:
                raise MismatchError(f"engine check failed: {exc}", tensor=spec.name) from exc

    async def _on_bucket(
        self, key: bytes, session: _Session, envelope: list[bytes], message: Bucket
    ) -> None:
        if await self._refuse_if_busy(key, session, envelope, message):
            return
        try:
            self._check_specs(session, message)
        except SequenceError:
            raise
        except AiosyncError as exc:
            if isinstance(exc, ProtocolError):
                self.protocol_errors += 1
            await self._refuse(key, session, envelope, message, exc)
            return
        self._streaming = key
        buffer = session.buffers[message.buffer].tensor
        items = [(spec, spec_bytes(buffer, spec)) for spec in message.specs]
        if not self.sink.staged:
            self.servable = False
        try:
            await anyio.to_thread.run_sync(self.sink.apply_bucket, items, limiter=self._limiter)
        except Exception as exc:
            names = ", ".join(spec.name for spec in message.specs[:3])
            error = AiosyncError(
                f"engine failed to apply bucket ({names}): {exc}",
                tensor=message.specs[0].name if message.specs else None,
            )
            await self._refuse(key, session, envelope, message, error)
            return
        session.last_progress = time.monotonic()
        await self._reply(envelope, session.protocol.bucket_applied(message))

    async def _refuse(
        self,
        key: bytes,
        session: _Session,
        envelope: list[bytes],
        message: Bucket | Complete,
        exc: AiosyncError,
    ) -> None:
        """Fail the open stream (recording why, once) and answer ``message`` with the error."""
        if session.protocol.phase is not Phase.FAILED:
            self._record_failure(session.peer, message.version, str(exc))
        session.protocol.fail()
        self._end_stream(key)
        await self._reply(
            envelope, Ack(seq=message.seq, ok=False, error=str(exc), tensor=exc.tensor)
        )

    async def _on_complete(
        self, key: bytes, session: _Session, envelope: list[bytes], message: Complete
    ) -> None:
        if await self._refuse_if_busy(key, session, envelope, message):
            return
        try:
            session.protocol.check_complete(message)
        except SequenceError:
            raise
        except AiosyncError as exc:
            await self._refuse(key, session, envelope, message, exc)
            return
        try:
            await anyio.to_thread.run_sync(self.sink.commit, message.version, limiter=self._limiter)
        except Exception as exc:
            self.servable = False  # a commit that broke half-way may have mixed the weights
            error = AiosyncError(f"engine failed to commit: {exc}", version=message.version)
            await self._refuse(key, session, envelope, message, error)
            return
        ack = session.protocol.committed(message)
        session.last_progress = time.monotonic()
        self.current_version = message.version
        self.servable = True
        self._streaming = None
        self._committed.set()
        self._committed = anyio.Event()
        log.info("committed version %d from %s", message.version, session.peer)
        await self._reply(envelope, ack)
        if self._on_commit is not None:
            try:
                await anyio.to_thread.run_sync(self._on_commit, message.version)
            except Exception:
                log.exception("on_commit hook failed for version %d", message.version)

    def _end_stream(self, key: bytes) -> None:
        """Forget the stream ``key`` had open (if any) and whatever the sink staged for it."""
        if self._streaming != key:
            return  # nothing of this sender's reached the sink, or another sender's is live
        self._streaming = None
        try:
            self.sink.abort()
        except Exception:
            log.exception("sink failed to abort")

    def _record_failure(self, peer: str, version: int | None, reason: str) -> None:
        failure = SyncFailure(peer, version, reason)
        self.failures.append(failure)
        log.warning(
            "version %s from %s did not commit: %s (engine stays at %s%s)",
            version,
            peer,
            reason,
            self.current_version,
            "" if self.servable else ", not servable",
        )

    def _drop_session(self, key: bytes, why: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        self._end_stream(key)
        session.close()
        log.info("session %s closed: %s", session.peer, why)
