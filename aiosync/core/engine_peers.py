"""What an engine keeps of each sender's session (plain records, no behaviour)."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from aiosync.core.stream_state import StreamState


class Phase(enum.Enum):
    """Where one sender's session stands."""

    OPENING = "opening"
    IDLE = "idle"
    STREAMING = "streaming"
    PREPARED = "prepared"
    COMMITTING = "committing"


@dataclass
class SenderSession:
    """One sender as its engine sees it: names, plane, times and open stream.

    ``seen``/``progress``: the loop's clock at its last message and at its stream's last
    step; ``failed_version``: the version of its last stream that failed (later messages
    of it are answered "stream already failed"); ``timeout``: the longest it said it waits
    for an answer (None: not stated); ``holder``: whose share of the engine's sessions it
    takes (:func:`aiosync.core.shares.holder`).
    """

    name: str
    session: str
    sizes: list[int]
    seen: float
    progress: float
    phase: Phase = Phase.OPENING
    stream: StreamState | None = None
    failed_version: int | None = None
    timeout: float | None = None
    holder: Hashable = None
