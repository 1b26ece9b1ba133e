"""What the engine's session machine asks its IO layer to do (plain data, no behaviour)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from aiosync.core.layout import TensorSpec
from aiosync.core.wire import Message, PlaneSpec, Region

Peer = Hashable
"""Whatever the IO layer uses to tell senders apart (a channel's name)."""


@dataclass(frozen=True)
class Reply:
    """Send ``message`` to ``peer``."""

    peer: Peer
    message: Message


@dataclass(frozen=True)
class OpenPlane:
    """Open the data plane ``plane`` for ``peer``; report with ``plane_opened``/``plane_failed``."""

    peer: Peer
    plane: PlaneSpec


@dataclass(frozen=True)
class ClosePlane:
    """Release ``peer``'s data plane; its session is over."""

    peer: Peer


@dataclass(frozen=True)
class Apply:
    """Hand the sink ``specs`` read from ``peer``'s buffer; report with ``applied``.

    ``regions``: the bucket's trainer memory (direct mode), unchecked: the plane checks them.
    ``digest``/``held``: the bucket's content digest, and whether the engine's own store
    (not the buffer) holds its bytes (:mod:`aiosync.engine.held`). ``after``: the reads
    wait until the trainer's counter reaches it (``Bucket.after``), unchecked: the plane
    checks it.
    """

    peer: Peer
    version: int
    seq: int
    buffer: int
    used: int
    specs: list[TensorSpec]
    regions: list[Region] = field(default_factory=list)
    digest: bytes | None = None
    held: bool = False
    after: int | None = None


@dataclass(frozen=True)
class Discard:
    """Tell the sink to forget what it took of ``version`` (the stream will not commit)."""

    version: int


@dataclass(frozen=True)
class CommitSink:
    """Make ``version`` visible in the sink; report with ``commit_done``/``commit_failed``.

    ``deadline`` (wall clock, ``time.time()``; None: none): the sender's, past which
    nothing may be made live (nor acknowledged as staged).
    """

    peer: Peer
    version: int
    deadline: float | None = None


@dataclass(frozen=True)
class Committed:
    """``version`` is now current (for hooks and waiters)."""

    version: int


@dataclass(frozen=True)
class Note:
    """Something an operator should see in the log (a rebase of the numbering, say)."""

    text: str


Action = Reply | OpenPlane | ClosePlane | Apply | Discard | CommitSink | Committed | Note


@dataclass(frozen=True)
class SyncFailure:
    """A stream that did not commit: who sent it, which version, and why."""

    peer: str
    version: int | None
    reason: str
