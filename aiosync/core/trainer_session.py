"""The sender's protocol state as pure machines: one per engine link, one per fleet vote.

:class:`LinkSession` is what a sender knows of one engine: the protocol it confirmed, the
engine's committed version and which of its messages still await an ack (acks come back in
order, so a mismatch means the two sides disagree), including a commit whose answer never
came (the version is then in doubt until that answer arrives). :class:`FleetVote` decides a
version's fate across engines under a :class:`Policy`: two-phase, every required engine
first prepares, then all commit. Nothing here does IO.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from aiosync.core.errors import (
    AiosyncError,
    FleetError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
)
from aiosync.core.limits import Limits
from aiosync.core.wire import PROTOCOL, Ack, Hello, PlaneSpec, Ready, spoken


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
        self._commit: int | None = None  # the seq of the open stream's commit, once sent
        self._leftovers: deque[tuple[int | None, int]] = deque()  # due for failed streams
        self.doubt: tuple[int, int] | None = None  # (version, seq): a commit never answered

    def hello(self, sender: str, plane: PlaneSpec) -> Hello:
        """The session's opening message."""
        return Hello(PROTOCOL, PROTOCOL, self.session, sender, plane)

    def ready(self, ready: Ready) -> None:
        """Accept the engine's reply to hello (its session and this side's protocol)."""
        if ready.session != self.session:
            raise ProtocolError(f"ready names session {ready.session!r}", peer=self.peer)
        if ready.protocol != PROTOCOL:
            raise ProtocolError(
                f"the engine chose protocol {ready.protocol}, this sender speaks "
                f"{spoken(PROTOCOL, PROTOCOL)} (run the same aiosync release on both ends)",
                peer=self.peer,
            )
        self.protocol = ready.protocol
        self.remote_version = ready.version
        self.limits = ready.limits

    def begin(self, version: int, *, rebase: bool = False) -> None:
        """Open the stream of ``version``; it must be newer than the engine's (but to rebase).

        An older or equal one is refused (:class:`RejectedError`, the session stays usable).
        """
        self._require_ready()
        remote = self.remote_version
        if not rebase and remote is not None and version <= remote:
            held = " (it holds this version already)" if version == remote else ""
            raise RejectedError(
                f"version {version} is not newer than the engine's {remote}{held}",
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
        self._commit = None

    def sent(self, seq: int) -> None:
        """A message ``seq`` of the open stream went out and awaits its ack."""
        self._pending.append(seq)

    def sent_commit(self, seq: int) -> None:
        """The open stream's commit, message ``seq``, went out and awaits its ack."""
        self.sent(seq)
        self._commit = seq

    @property
    def commit_pending(self) -> bool:
        """Whether the open stream's commit went out and its answer has not come."""
        return self._commit is not None and self._commit in self._pending

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
            due = self._leftovers.popleft()
            if due == self.doubt and ack.seq == due[1]:  # the answer to a commit in doubt
                self.doubt = None
                if ack.ok and ack.version == due[0]:
                    self.remote_version = due[0]
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
        self._commit = None

    def failed(self) -> None:
        """The stream broke; the acks still on their way will be skipped.

        A commit among them leaves its version in doubt (:attr:`doubt`) until its answer
        comes: an ok one makes it the engine's version.
        """
        if self.commit_pending and self.version is not None and self._commit is not None:
            self.doubt = (self.version, self._commit)
        self._leftovers.extend((self.version, seq) for seq in self._pending)
        self.version = None
        self._commit = None
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
        self.current: list[str] = []  # held the version already: nothing to send them

    def hold(self, engine: str) -> None:
        """``engine`` holds the version already (a retry): it takes no part in the stream."""
        if engine not in self.failed and engine not in self.current:
            self.current.append(engine)
            if engine in self.prepared:
                self.prepared.remove(engine)

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
        """Engines still in the stream (neither failed nor holding the version already)."""
        return [e for e in self.engines if e not in self.failed and e not in self.current]

    @property
    def hopeless(self) -> bool:
        """True once no outcome but abort is possible (stop streaming at once)."""
        out = not self.live and not self.current
        return (bool(self.failed) and self.policy is Policy.ALL) or out

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
        done = (*self.prepared, *self.failed, *self.current)
        if all(e in done for e in self.engines):
            return Verdict.COMMIT
        return Verdict.PENDING


@dataclass(frozen=True)
class EngineOutcome:
    """How one engine ended one version: its status, version now, seconds and error.

    ``status``: ``"committed"``; ``"current"`` (it held the version already, nothing was
    sent); ``"failed"``, ``"aborted"`` or ``"lost after prepare"`` (it did not commit it);
    ``"in doubt"`` (it went silent with the commit sent: it may hold the version, which its
    next contact says; it makes nothing live past the commit's deadline).
    """

    engine: str
    status: str
    version: int | None
    seconds: float | None = None
    error: str | None = None
