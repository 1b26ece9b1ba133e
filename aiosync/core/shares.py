"""Fair shares of what many peers draw on: who holds a slot, and whose slot may go (pure).

A resource of ``total`` slots (an engine's sessions, a server's control channels) is held
by *holders*: the CURVE key a peer authenticated with, or, without CURVE, the peer itself.
No holder may take more than its share, so one key cannot exhaust what others need. On
``ipc://`` (no keys) every connection is a holder of its own and a process may open as
many as it likes: there shares guard against bugs, not attackers. Pings keep a session
alive, not its slot: once every slot is taken, a newcomer may take the slot of a session
that had no version in progress for the idle bound (:func:`idle_victim`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

Holder = Hashable
"""A CURVE key (its Z85 bytes), or the peer itself where there are no keys."""


def holder(peer: Hashable, key: bytes | None) -> Holder:
    """Who ``peer``'s slots count against: its CURVE key, else the peer itself."""
    return ("key", key) if key is not None else ("peer", peer)


def half_of(total: int) -> int:
    """The default share of ``total`` slots: half, so that one holder leaves the rest."""
    return max(1, total // 2)


def shown(who: Holder) -> str:
    """A holder as a log line or refusal names it: a key's first 8 characters, or the peer."""
    if isinstance(who, tuple) and len(who) == 2:
        kind, value = who
        if kind == "key" and isinstance(value, bytes):
            return f"key {value[:8].decode('ascii', 'replace')}..."
        return str(value)
    return str(who)


def over_share(held: Iterable[Holder], who: Holder, share: int) -> str | None:
    """Why ``who`` may not take one more slot, holding those of ``held`` it holds (None: it may)."""
    count = sum(1 for h in held if h == who)
    if count < share:
        return None
    return f"{shown(who)} holds {count} of them (at most {share} each)"


def idle_victim(
    idle_since: Mapping[Hashable, float | None],
    holders: Mapping[Hashable, Holder],
    now: float,
    bound: float,
) -> Hashable | None:
    """The slot a newcomer may take once every slot is taken, or None.

    ``idle_since`` gives each slot's owner the time its last version ended (None: a
    version is in progress, never taken). Of those idle for ``bound`` or longer, the one of
    the holder with the most slots goes, the longest idle first.
    """
    counts: dict[Holder, int] = {}
    for who in holders.values():
        counts[who] = counts.get(who, 0) + 1
    idle = [
        (-counts.get(holders.get(peer), 0), since, index, peer)
        for index, (peer, since) in enumerate(idle_since.items())
        if since is not None and now - since >= bound
    ]
    return min(idle)[3] if idle else None
