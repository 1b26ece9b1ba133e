"""Pure state machines for both ends of a weight stream (no IO, no torch buffers).

The IO layers feed every decoded message through these objects, which reject anything out
of order (wrong sequence number, wrong version, a bucket before the hello, a commit with
missing pieces) with a :class:`~aiosync.errors.ProtocolError` that says what was expected.
Message order, in short::

    Hello -> Ready, then per version: Bucket* -> Complete, each answered by an Ack.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from aiosync.errors import ProtocolError, RejectedError
from aiosync.layout import TensorSpec, validate_specs
from aiosync.wire import PROTOCOL_VERSION, Abort, Ack, Bucket, Complete, Goodbye, Hello, Ready


class SequenceError(ProtocolError):
    """A message out of the session's order (before hello, after goodbye, a gap in ``seq``).

    After one of these the two sides no longer agree on the session, which must end.
    """


class Phase(enum.Enum):
    """Where one side of a session stands."""

    HANDSHAKE = "handshake"
    IDLE = "idle"
    STREAMING = "streaming"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass
class StreamProgress:
    """What the receiver has applied of the version now streaming."""

    version: int
    buckets: int = 0
    tensors: int = 0
    done: set[str] = field(default_factory=set)
    partial: dict[str, TensorSpec] = field(default_factory=dict)  # last chunk seen, by name

    @property
    def received(self) -> dict[str, int]:
        """Bytes received so far of each tensor that is still incomplete."""
        return {name: spec.start + spec.nbytes for name, spec in self.partial.items()}


class ReceiverProtocol:
    """The receiver's view of one sender session.

    Call :meth:`hello` first, :meth:`check_bucket` before touching memory, then
    :meth:`bucket_applied` or :meth:`fail`; :meth:`check_complete` before committing, then
    :meth:`committed`. Every method raises :class:`ProtocolError` on an illegal step.
    """

    def __init__(self, peer: str, current_version: int | None = None) -> None:
        self.peer = peer
        self.phase = Phase.HANDSHAKE
        self.current_version = current_version
        self.session: str | None = None
        self.buffer_sizes: list[int] = []
        self.next_seq = 0
        self.stream: StreamProgress | None = None

    def _error(self, message: str, *, version: int | None = None) -> ProtocolError:
        return ProtocolError(message, peer=self.peer, version=version)

    def hello(self, msg: Hello) -> Ready:
        """Accept a session's opening message; returns the reply to send once buffers map."""
        if self.phase is not Phase.HANDSHAKE:
            raise self._error("second hello on an open session")
        if msg.protocol != PROTOCOL_VERSION:
            raise self._error(
                f"protocol version {msg.protocol} not supported (this side speaks "
                f"{PROTOCOL_VERSION})"
            )
        if not msg.buffers:
            raise self._error("hello lists no buffers")
        self.session = msg.session
        self.buffer_sizes = [handle.size for handle in msg.buffers]
        self.phase = Phase.IDLE
        return Ready(session=msg.session, version=self.current_version)

    def take_seq(self, seq: int, version: int) -> None:
        """Accept ``seq`` as the session's next message (:class:`SequenceError` if it is not).

        The check methods call this themselves; call it directly for a message that is
        refused before it reaches them, so both sides stay in step.
        """
        if self.phase is Phase.HANDSHAKE:
            raise SequenceError("message before hello", peer=self.peer, version=version)
        if self.phase is Phase.CLOSED:
            raise SequenceError("message after goodbye", peer=self.peer, version=version)
        if seq != self.next_seq:
            raise SequenceError(
                f"sequence {seq} out of order (expected {self.next_seq})",
                peer=self.peer,
                version=version,
            )
        self.next_seq += 1

    def _require_newer(self, version: int) -> None:
        if self.current_version is not None and version <= self.current_version:
            raise self._error(
                f"version {version} is not newer than current {self.current_version}",
                version=version,
            )

    def _open_stream(self, version: int) -> None:
        self._require_newer(version)
        self.stream = StreamProgress(version)
        self.phase = Phase.STREAMING

    def check_bucket(self, msg: Bucket) -> None:
        """Validate a bucket's place in the stream and its layout; opens a stream if needed."""
        self.take_seq(msg.seq, msg.version)
        stream = self.stream
        if stream is None or stream.version != msg.version:
            if stream is not None and self.phase is Phase.STREAMING:
                raise self._error(
                    f"bucket of version {msg.version} while version {stream.version} is open",
                    version=msg.version,
                )
            self._open_stream(msg.version)
        elif self.phase is Phase.FAILED:
            raise RejectedError("stream already failed", peer=self.peer, version=msg.version)
        if not 0 <= msg.buffer < len(self.buffer_sizes):
            raise self._error(f"no buffer {msg.buffer}", version=msg.version)
        try:
            validate_specs(msg.specs, msg.used, self.buffer_sizes[msg.buffer])
        except ProtocolError as exc:
            raise ProtocolError(
                exc.reason, peer=self.peer, version=msg.version, tensor=exc.tensor
            ) from None
        progress = self.stream
        assert progress is not None
        in_bucket: set[str] = set()
        for spec in msg.specs:
            if spec.name in progress.done or spec.name in in_bucket:
                raise self._error(f"tensor {spec.name!r} sent twice", version=msg.version)
            in_bucket.add(spec.name)
            previous = progress.partial.get(spec.name)
            expected = 0 if previous is None else previous.start + previous.nbytes
            if spec.start != expected:
                raise ProtocolError(
                    f"chunk starts at byte {spec.start}, expected {expected}",
                    peer=self.peer,
                    version=msg.version,
                    tensor=spec.name,
                )
            if previous is not None and (previous.dtype, previous.shape) != (
                spec.dtype,
                spec.shape,
            ):
                raise ProtocolError(
                    "chunks disagree on dtype or shape",
                    peer=self.peer,
                    version=msg.version,
                    tensor=spec.name,
                )

    def bucket_applied(self, msg: Bucket) -> Ack:
        """Record a bucket the sink applied; returns its positive ack."""
        progress = self.stream
        assert progress is not None
        assert progress.version == msg.version
        progress.buckets += 1
        for spec in msg.specs:
            if spec.is_last_chunk:
                progress.partial.pop(spec.name, None)
                progress.done.add(spec.name)
                progress.tensors += 1
            else:
                progress.partial[spec.name] = spec
        return Ack(seq=msg.seq, ok=True)

    def fail(self) -> None:
        """Mark the open stream broken: later buckets of it are refused until a new version."""
        if self.stream is not None:
            self.phase = Phase.FAILED

    def check_complete(self, msg: Complete) -> None:
        """Validate a commit request against everything applied for its version."""
        self.take_seq(msg.seq, msg.version)
        progress = self.stream
        if progress is None and msg.buckets == 0 and self.phase is Phase.IDLE:
            self._open_stream(msg.version)  # a version with no tensors at all
            progress = self.stream
        if progress is None or progress.version != msg.version:
            raise self._error("complete for a version that was never streamed", version=msg.version)
        self._require_newer(msg.version)  # another session may have committed since it opened
        if self.phase is Phase.FAILED:
            raise RejectedError("stream failed earlier", peer=self.peer, version=msg.version)
        if progress.partial:
            name = next(iter(progress.partial))
            raise ProtocolError(
                "tensor incomplete at commit", peer=self.peer, version=msg.version, tensor=name
            )
        if (msg.buckets, msg.tensors) != (progress.buckets, progress.tensors):
            raise self._error(
                f"sender counted {msg.buckets} buckets / {msg.tensors} tensors, receiver "
                f"applied {progress.buckets} / {progress.tensors}",
                version=msg.version,
            )

    def committed(self, msg: Complete) -> Ack:
        """Make ``msg.version`` current; returns the positive ack."""
        self.current_version = msg.version
        self.stream = None
        self.phase = Phase.IDLE
        return Ack(seq=msg.seq, ok=True)

    def abort(self, msg: Abort) -> None:
        """Drop the open stream (the sender gave up on it)."""
        if self.phase is Phase.HANDSHAKE:
            raise self._error("abort before hello")
        self.stream = None
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.IDLE

    def goodbye(self, msg: Goodbye) -> None:
        """Close the session; any unfinished stream is dropped."""
        if msg.session != self.session:
            raise self._error(f"goodbye for unknown session {msg.session!r}")
        self.stream = None
        self.phase = Phase.CLOSED


class SenderProtocol:
    """The sender's view of one session: sequence numbers, versions and pending acks."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.phase = Phase.HANDSHAKE
        self.session: str | None = None
        self.remote_version: int | None = None
        self.version: int | None = None
        self._next_seq = 0
        self._pending: deque[int] = deque()
        self._stale_below = 0

    def ready(self, msg: Ready) -> None:
        """Accept the receiver's handshake reply."""
        if self.phase is not Phase.HANDSHAKE:
            raise ProtocolError("unexpected ready", peer=self.peer)
        if msg.session != self.session:
            raise ProtocolError(f"ready names session {msg.session!r}", peer=self.peer)
        self.remote_version = msg.version
        self.phase = Phase.IDLE

    def begin(self, version: int) -> None:
        """Open the stream of ``version``; it must be newer than anything committed."""
        if self.phase is not Phase.IDLE:
            raise ProtocolError(f"cannot start a stream while {self.phase.value}", peer=self.peer)
        if self.remote_version is not None and version <= self.remote_version:
            raise ProtocolError(
                f"version {version} is not newer than the receiver's {self.remote_version}",
                peer=self.peer,
                version=version,
            )
        self.version = version
        self.phase = Phase.STREAMING

    def next_seq(self) -> int:
        """Reserve the sequence number of the next outgoing bucket or complete."""
        seq = self._next_seq
        self._next_seq += 1
        self._pending.append(seq)
        return seq

    @property
    def in_flight(self) -> int:
        """Messages sent and not yet acknowledged."""
        return len(self._pending)

    def ack(self, msg: Ack) -> int | None:
        """Match an ack to the oldest outstanding message; returns its sequence number.

        Acks left over from a stream that already failed are recognised and return None.
        """
        if msg.seq < self._stale_below:
            return None
        if not self._pending:
            raise ProtocolError(f"ack {msg.seq} with nothing outstanding", peer=self.peer)
        expected = self._pending[0]
        if msg.seq != expected:
            raise ProtocolError(
                f"ack {msg.seq} out of order (expected {expected})",
                peer=self.peer,
                version=self.version,
            )
        self._pending.popleft()
        return expected

    def committed(self) -> None:
        """The receiver acknowledged the complete: the version is now remote's current."""
        self.remote_version = self.version
        self.phase = Phase.IDLE

    def failed(self) -> None:
        """The stream broke; outstanding acks are forgotten and a new version may start."""
        self._pending.clear()
        self._stale_below = self._next_seq
        if self.phase is not Phase.HANDSHAKE:
            self.phase = Phase.IDLE
