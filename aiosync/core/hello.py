"""What each side checks of the other's opening (pure functions, no IO).

At the ``hello`` an engine checks what a sender's plane would make it map, and whether the
sender gets one of its session slots (:mod:`aiosync.core.shares`); at the ``ready``
a sender checks whether its own wait covers the engine's longest one: an engine that
answers a commit once it is live (``ack_at="live"``) may first wait up to its
``swap_timeout`` for read leases. It never waits past the commit's deadline (so a sender
that gave up never leaves an engine that commits later), but a sender whose timeout is
shorter sees versions refused under long leases: it is warned, naming both values.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from aiosync.core.engine_peers import Phase, SenderSession
from aiosync.core.limits import Limits
from aiosync.core.shares import idle_victim, over_share
from aiosync.core.wire import Ready


def plane_problem(sizes: list[int], limits: Limits) -> str | None:
    """Why an engine refuses a plane of buffers of ``sizes`` bytes (None: it takes it)."""
    if not sizes or len(sizes) > limits.max_buffers or min(sizes) <= 0:
        return f"session refused: {len(sizes)} buffers (1-{limits.max_buffers}, positive)"
    if sum(sizes) > limits.max_session_bytes:
        most = limits.max_session_bytes
        return f"session refused: {sum(sizes)} bytes of buffers (at most {most})"
    return None


def session_slot(
    sessions: Mapping[Hashable, SenderSession],
    who: Hashable,
    limits: Limits,
    now: float,
    idle_bound: float,
) -> tuple[str | None, tuple[Hashable, str] | None]:
    """Whether a new session of holder ``who`` gets a slot among ``sessions``.

    Returns the refusal (None: it gets one) and, when every slot is taken, the session to
    close for it with what that session is told: the one longest without a version in
    progress, if that lasted ``idle_bound`` (pings keep a session, not its slot). A holder
    already at its share (``max_sessions_per_key``) is refused outright.
    """
    over = over_share((s.holder for s in sessions.values()), who, limits.max_sessions_per_key)
    if over is not None:
        return f"session refused: {over}", None
    most = limits.max_sessions
    if len(sessions) < most:
        return None, None
    idle = {p: s.progress if s.phase is Phase.IDLE else None for p, s in sessions.items()}
    holders = {p: s.holder for p, s in sessions.items()}
    victim = idle_victim(idle, holders, now, idle_bound)
    if victim is None:
        return f"session refused: {most} sessions are open", None
    seconds = now - sessions[victim].progress
    why = f"session closed: no version for {seconds:.0f}s while all {most} session slots are wanted"
    return None, (victim, why)


def uncovered(timeout: float, ready: Ready) -> str | None:
    """What to warn of when a sender waiting ``timeout`` seconds for an ack meets this engine.

    None when nothing: the engine states no wait (an in-place sink) or
    acknowledges commits once staged, or ``timeout`` is above its ``swap_timeout``.
    """
    waits = ready.swap_timeout
    if waits is None or ready.ack_at != "live" or timeout > waits:
        return None
    return (
        f"the sender's timeout ({timeout:g}s) does not cover the engine's swap_timeout "
        f"({waits:g}s, ack_at='live'): a commit waits for read leases only until the "
        "sender's deadline, and one still held back then is refused; set "
        f"SenderConfig(timeout=...) above {waits:g}s, or ReceiverConfig(swap_timeout=...) "
        "below the sender's timeout (or ack_at='staged') on the engine"
    )


def stated_timeout(value: float | None) -> float | None:
    """A peer's stated timeout if it is a plain positive number of seconds (else None)."""
    if value is None or not 0 < value < float("inf"):
        return None
    return value
