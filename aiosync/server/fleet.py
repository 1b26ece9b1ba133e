"""The server's subscribers as pure bookkeeping: versions, lag bounds and what to send next.

Each subscriber declares how many versions it may lag (``max_lag``); lag counts published
versions newer than the one it holds, whatever their numbers. A following subscriber is
always sent the newest retained version whole (never a version in between, never a mix);
one that fetched a named version is held there until it follows again. No IO here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from aiosync.core.errors import UsageError
from aiosync.core.limits import shorten

HISTORY = 1 << 16
"""Published version numbers remembered for counting lag (the oldest are forgotten)."""


@dataclass
class SubscriberState:
    """What the server knows of one subscriber."""

    name: str
    max_lag: int
    version: int | None = None
    follow: bool = True
    target: int | None = None  # a fetched version, while not following
    connected: bool = True
    transfers: int = 0
    bytes_sent: int = 0  # bucket bytes sent (every transfer, failed ones too)
    bytes_held: int = 0  # bucket bytes it was not sent because it held them
    last_error: str | None = None
    resume: bool = False  # name each bucket by digest: it keeps them to resume
    held: frozenset[bytes] = frozenset()  # digests it holds from an unfinished version


@dataclass
class FleetBook:
    """Every subscriber by name, and the versions published (to count lag)."""

    subscribers: dict[str, SubscriberState] = field(default_factory=dict)
    published: list[int] = field(default_factory=list)  # ascending

    def add(self, name: str, max_lag: int, *, follow: bool = True) -> SubscriberState:
        """A new subscriber (a name in use is a :class:`UsageError`)."""
        if max_lag < 0:
            raise UsageError(f"max_lag must not be negative, got {max_lag}")
        if name in self.subscribers:
            raise UsageError(f"a subscriber named {name!r} is already connected")
        state = SubscriberState(name, max_lag, follow=follow)
        self.subscribers[name] = state
        return state

    @property
    def books(self) -> list[SubscriberState]:
        """Every subscriber now."""
        return list(self.subscribers.values())

    def remove(self, name: str) -> None:
        """Forget a subscriber (it no longer counts towards bounds)."""
        self.subscribers.pop(name, None)

    def publish(self, version: int) -> None:
        """A version was published (committed by the server)."""
        if self.published and version <= self.published[-1]:
            # a rebased publisher: count from here on
            self.published.clear()
        self.published.append(version)
        del self.published[:-HISTORY]

    @property
    def newest(self) -> int | None:
        """The newest version published."""
        return self.published[-1] if self.published else None

    def lag(self, name: str) -> int:
        """Published versions newer than the subscriber's (all of them before its first)."""
        state = self.subscribers[name]
        if state.version is None:
            return len(self.published)
        return len(self.published) - bisect.bisect_right(self.published, state.version)

    def within_bound(self, name: str) -> bool:
        """Whether it lags no more than it declared (without a version: only if none exists)."""
        if self.subscribers[name].version is None:
            return not self.published
        return self.lag(name) <= self.subscribers[name].max_lag

    def all_within_bounds(self) -> bool:
        """Whether every subscriber is within its bound."""
        return all(self.within_bound(name) for name in self.subscribers)

    def have(self, version: int, names: list[str] | None = None) -> bool:
        """Whether every named subscriber (default: all) holds ``version`` or newer.

        A named subscriber that is not connected does not have it.
        """
        for name in self.subscribers if names is None else names:
            state = self.subscribers.get(name)
            if state is None or state.version is None or state.version < version:
                return False
        return True

    def next_version(self, name: str, retained: list[int]) -> int | None:
        """The version to send ``name`` now, if any.

        Following: the newest retained, when newer than what it holds. Fetching: the
        target while retained and not held; a target no longer retained is dropped.
        """
        state = self.subscribers[name]
        if not retained:
            return None
        if not state.follow:
            if state.target is None or state.target == state.version:
                return None
            if state.target not in retained:
                state.target = None
                return None
            return state.target
        newest = retained[-1]
        if state.version is None or newest > state.version:
            return newest
        return None


MAX_NAME = 256
"""Characters in a subscriber's name or endpoint."""


def subscription_problem(
    fleet: FleetBook, name: str, endpoint: str, max_lag: int, max_subscribers: int
) -> str | None:
    """Why a subscription (peer input) is refused, or None when it may go ahead."""
    if len(name) > MAX_NAME or len(endpoint) > MAX_NAME:
        return f"name or endpoint longer than {MAX_NAME} characters"
    if not endpoint.startswith(("ipc://", "tcp://")):
        return f"endpoint {shorten(endpoint, 64)!r} is not ipc:// or tcp://"
    if len(fleet.subscribers) >= max_subscribers:
        return f"already {max_subscribers} subscribers"
    if name in fleet.subscribers:
        return f"a subscriber named {name!r} is connected"
    if max_lag < 0:
        return "max_lag must not be negative"
    return None
