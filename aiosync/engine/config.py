"""How an engine's receiver waits and what it accepts: :class:`ReceiverConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from aiosync.core.limits import Limits

AckAt = Literal["live", "staged"]
ACK_AT: tuple[AckAt, ...] = ("live", "staged")


@dataclass(frozen=True)
class ReceiverConfig:
    """Timeouts of a receiver, in seconds, and when a sender's commit is acknowledged.

    ``stream_timeout``: the longest a sender may go without a bucket or commit in the middle
    of a version before the stream is dropped. ``session_timeout``: the longest a session
    may go without any message (senders send keepalives while idle) before it is closed and
    its buffers unmapped. ``reply_timeout`` bounds sending one reply. ``limits`` bound what
    any one peer may send (sizes, counts, version steps); senders learn them at hello.
    ``swap_timeout``: the longest a new version waits for read leases to be released before
    it is refused (and the longest a new lease waits for a swap, and the longest the
    receiver's ``on_live`` hook is waited for); keep it under senders' timeouts.

    ``ack_at`` says what the sender's commit acknowledgement promises (it matters only for a
    staged sink; for an in-place sink a version is live as soon as it is staged):

    * ``"live"`` (default): the ack is sent once the version is live: every lease taken
      after it reads the new weights and ``current_version`` is the new version (and the
      receiver's ``on_live`` hook, if any, has returned). A version that cannot go live
      within ``swap_timeout`` is refused, so the sender hears it.
    * ``"staged"``: the ack is sent as soon as the whole version is checked and staged in the
      engine, before waiting for read leases; the sender's ``send`` returns while requests
      may still read the previous version. The version then goes live at the first moment
      no lease is held (new leases wait for it, as in ``"live"``), and until then
      ``current_version`` and :meth:`~aiosync.WeightReceiver.serving` still report the
      previous version, whose weights are the ones read. The ack no longer promises that
      the version goes live: if leases are held past ``swap_timeout`` it is dropped (logged
      and kept in ``failures``; the weights stay as they were) and the sender is not told.
      The engine takes no message from any sender until the swap is done, so a sender's
      next version waits for it: keep senders' timeouts above ``swap_timeout``.
    """

    stream_timeout: float = 60.0
    session_timeout: float = 60.0
    reply_timeout: float = 10.0
    swap_timeout: float = 30.0
    limits: Limits = field(default_factory=Limits)
    ack_at: AckAt = "live"

    def __post_init__(self) -> None:
        timeouts = (self.stream_timeout, self.session_timeout, self.reply_timeout)
        if min(*timeouts, self.swap_timeout) <= 0:
            raise ValueError("receiver timeouts must be positive")
        if self.ack_at not in ACK_AT:
            raise ValueError(f"ack_at must be one of {ACK_AT}, got {self.ack_at!r}")
