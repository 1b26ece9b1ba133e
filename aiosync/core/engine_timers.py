"""When an engine's sessions time out: pure functions of the sessions and the clock."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from aiosync.core.engine_actions import Peer
from aiosync.core.engine_peers import Phase, SenderSession


def deadline(session: SenderSession, stream_timeout: float, session_timeout: float) -> float:
    """When ``session`` times out: ``stream_timeout`` after progress in mid-stream."""
    if session.stream is not None:
        return session.progress + stream_timeout
    return session.seen + session_timeout


def next_deadline(
    sessions: Mapping[Peer, SenderSession], stream_timeout: float, session_timeout: float
) -> float | None:
    """The first deadline among ``sessions`` (a committing one waits for none), or None."""
    waiting = [s for s in sessions.values() if s.phase is not Phase.COMMITTING]
    return min((deadline(s, stream_timeout, session_timeout) for s in waiting), default=None)


def expired(
    sessions: Mapping[Peer, SenderSession],
    now: float,
    stream_timeout: float,
    session_timeout: float,
) -> Iterator[tuple[Peer, str]]:
    """Each session silent past its deadline at ``now``, with the reason it ends."""
    for peer, session in list(sessions.items()):
        if session.phase is Phase.COMMITTING:
            continue
        if now < deadline(session, stream_timeout, session_timeout):
            continue
        silent = now - session.progress
        why = f"sender made no progress for {silent:.1f}s in mid-stream (silent)"
        yield peer, why if session.stream else "session timed out"
