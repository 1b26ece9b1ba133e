"""How an engine's receiver waits and what it accepts: :class:`ReceiverConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiosync.core.limits import Limits


@dataclass(frozen=True)
class ReceiverConfig:
    """Timeouts of a receiver, in seconds.

    ``stream_timeout``: the longest a sender may go without a bucket or commit in the middle
    of a version before the stream is dropped. ``session_timeout``: the longest a session
    may go without any message (senders send keepalives while idle) before it is closed and
    its buffers unmapped. ``reply_timeout`` bounds sending one reply. ``limits`` bound what
    any one peer may send (sizes, counts, version steps); senders learn them at hello.
    ``swap_timeout``: the longest a new version waits for read leases to be released before
    it is refused (and the longest a new lease waits for a swap); keep it under senders'
    timeouts.
    """

    stream_timeout: float = 60.0
    session_timeout: float = 60.0
    reply_timeout: float = 10.0
    swap_timeout: float = 30.0
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        timeouts = (self.stream_timeout, self.session_timeout, self.reply_timeout)
        if min(*timeouts, self.swap_timeout) <= 0:
            raise ValueError("receiver timeouts must be positive")
