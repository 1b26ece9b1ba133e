"""The sender's protocol state as pure machines: one per engine link, one per fleet vote.

:class:`LinkSession` is what a sender knows of one engine: the negotiated protocol, the
engine's committed version and which of its messages still await an ack (acks come back in
order, so a mismatch means the two sides disagree). :class:`FleetVote` decides a version's
fate across engines under a :class:`Policy`: two-phase, every required engine first
prepares, then all commit. Nothing here does IO.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from aiosync.core.errors import AiosyncError, FleetError, PeerGoneError, ProtocolError
from aiosync.core.limits import Limits
from aiosync.core.wire import PROTOCOL_MAX, PROTOCOL_MIN, Ack, Hello, PlaneSpec, Ready


class LinkSession:
    """One engine as the sender sees it: handshake, versions and outstanding acks."""

    def __init__(self, peer: str, session: str) -> None:
        self.peer = peer
        self.session = session
        self.protocol: int | None = None
        self.remote_version: int | None = None
        self.limits = Limits()  # the engine's, from its ready
        self.version: int | None = None  # the stream open now, if any
        self._pending: deque[int] = deque()
        self._leftovers = 0  # acks still due for messages of streams that failed

    def hello(self, sender: str, plane: PlaneSpec) -> Hello:
        """The session's opening message."""
        return Hello(PROTOCOL_MIN, PROTOCOL_MAX, self.session, sender, plane)

    def ready(self, ready: Ready) -> None:
        """Accept the engine's reply to hello (its session and a protocol we speak)."""
        if ready.session != self.session:
            raise ProtocolError(f"ready names session {ready.session!r}", peer=self.peer)
        if not PROTOCOL_MIN <= ready.protocol <= PROTOCOL_MAX:
            raise ProtocolError(
                f"engine chose protocol {ready.protocol}; this side speaks "
                f"{PROTOCOL_MIN}-{PROTOCOL_MAX}",
                peer=self.peer,
            )
        self.protocol = ready.protocol
        self.remote_version = ready.version
        self.limits = ready.limits

    def begin(self, version: int) -> None:
        """Open the stream of ``version``; it must be newer than the engine's."""
        self._require_ready()
        if self.remote_version is not None and version <= self.remote_version:
            raise ProtocolError(
                f"version {version} is not newer than the engine's {self.remote_version}",
                peer=self.peer,
                version=version,
            )
        self._open(version)

    def follow(self, version: int) -> None:
        """Open the stream of ``version`` whatever the engine holds (it will refuse it).

        For a collective plane, whose engines must all join every broadcast: an engine
        that cannot take the version is still sent its buckets and drops them.
        """
        self._require_ready()
        self._open(version)

    def _require_ready(self) -> None:
        if self.protocol is None:
            raise ProtocolError("stream before the session is ready", peer=self.peer)

    def _open(self, version: int) -> None:
        self.version = version
        self._pending.clear()

    def sent(self, seq: int) -> None:
        """A message ``seq`` of the open stream went out and awaits its ack."""
        self._pending.append(seq)

    @property
    def in_flight(self) -> int:
        """Messages sent and not yet acknowledged."""
        return len(self._pending)

    def ack(self, ack: Ack) -> Ack | None:
        """Match an ack to the oldest outstanding message; None for a leftover of a past stream.

        The engine answers every stream message once and in order, so the acks still due
        when a stream failed are exactly the next ones to arrive, even when a retry reuses
        the failed stream's version number.
        """
        if self._leftovers:
            self._leftovers -= 1
            return None
        if not self._pending or ack.seq != self._pending[0] or ack.version != self.version:
            expected = self._pending[0] if self._pending else None
            raise ProtocolError(
                f"ack {ack.seq} out of order (expected {expected})",
                peer=self.peer,
                version=self.version,
            )
        self._pending.popleft()
        return ack

    def committed(self) -> None:
        """The engine acknowledged the commit: the version is its current one."""
        self.remote_version = self.version
        self.version = None

    def failed(self) -> None:
        """The stream broke; the acks still on their way will be skipped."""
        self.version = None
        self._leftovers += len(self._pending)
        self._pending.clear()


class Policy(enum.Enum):
    """Which engines must prepare a version before any of them commits it."""

    ALL = "all"
    """Every engine; one failure leaves every engine on its previous version."""
    AVAILABLE = "available"
    """Engines that prepared commit; the others are reported."""


class Verdict(enum.Enum):
    """What a fleet vote says now."""

    PENDING = "pending"
    COMMIT = "commit"
    ABORT = "abort"


@dataclass
class FleetVote:
    """The two-phase decision over one version's engines (by name)."""

    engines: list[str]
    policy: Policy

    def __post_init__(self) -> None:
        self.prepared: list[str] = []
        self.failed: dict[str, AiosyncError] = {}
        self.lost: dict[str, AiosyncError] = {}  # failed after preparing, once commit was due

    def fail(self, engine: str, error: AiosyncError) -> None:
        """``engine`` failed before it prepared (the first error per engine is kept)."""
        if engine not in self.prepared:
            self.failed.setdefault(engine, error)

    def lose(self, engine: str, error: AiosyncError) -> None:
        """``engine`` failed after it prepared: the decision stands, it is reported late."""
        self.lost.setdefault(engine, error)

    def prepare(self, engine: str) -> None:
        """``engine`` reported the version whole and checked."""
        if engine not in self.failed and engine not in self.prepared:
            self.prepared.append(engine)

    @property
    def live(self) -> list[str]:
        """Engines still in the stream (neither failed nor, for the vote, out)."""
        return [e for e in self.engines if e not in self.failed]

    @property
    def hopeless(self) -> bool:
        """True once no outcome but abort is possible (stop streaming at once)."""
        return (bool(self.failed) and self.policy is Policy.ALL) or not self.live

    def failure(self, version: int) -> AiosyncError:
        """The error to raise for a version no engine committed: each failed engine's own."""
        failed = {**self.failed, **self.lost}
        if len(failed) == 1:
            return next(iter(failed.values()))
        if not failed:
            return PeerGoneError("no engine committed the version", version=version)
        return FleetError(f"{len(failed)} engines failed", failed, version=version)

    def verdict(self) -> Verdict:
        """Commit once every required engine prepared; abort once that cannot happen."""
        if self.hopeless:
            return Verdict.ABORT
        if all(e in self.prepared or e in self.failed for e in self.engines):
            return Verdict.COMMIT
        return Verdict.PENDING


@dataclass(frozen=True)
class EngineOutcome:
    """How one engine ended one version: its status, version now, seconds and error."""

    engine: str
    status: str  # "committed", "failed", "aborted" or "lost after prepare"
    version: int | None
    seconds: float | None = None
    error: str | None = None
