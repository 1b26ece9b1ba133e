"""Which versions a server keeps, as pure bookkeeping: counts, bytes, pins and evictions.

A server retains the newest versions it was published, bounded by a count and by bytes
(:class:`RetentionPolicy`). A version being streamed to a subscriber is *pinned* and is
never evicted under it; a version arriving from a publisher is *pending* and counts
against the byte bound from its first bucket. :class:`RetentionBook` only decides; the
store (:mod:`aiosync.server.store`) frees the memory of what it names. No IO here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from aiosync.core.errors import UsageError


@dataclass(frozen=True)
class RetentionPolicy:
    """How much a server keeps: at most ``max_versions`` versions and ``max_bytes`` bytes.

    ``max_bytes`` (None: no byte bound) counts the retained versions plus the one being
    published; it must hold two versions (the newest stays while the next arrives). A
    pinned version (in flight to a subscriber) stays past the count until its transfer
    ends; the byte bound is never exceeded: a publisher then waits for a pin to go.
    """

    max_versions: int = 2
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_versions, int) or self.max_versions < 1:
            raise ValueError(f"max_versions must be a positive integer, got {self.max_versions!r}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes!r}")


@dataclass(frozen=True)
class Room:
    """The answer to a request for bytes: versions to evict now, and whether the bytes fit."""

    evict: tuple[int, ...]
    fits: bool


class RetentionBook:
    """Retained versions (oldest first) with their bytes, pins and the pending version's bytes."""

    def __init__(self, policy: RetentionPolicy) -> None:
        self.policy = policy
        self._versions: dict[int, int] = {}  # version -> bytes, in commit order
        self._pins: Counter[int] = Counter()
        self.pending = 0

    # --- reading --------------------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        """Retained versions, oldest first."""
        return list(self._versions)

    @property
    def newest(self) -> int | None:
        """The newest retained version (None before the first commit)."""
        return next(reversed(self._versions), None)

    @property
    def retained_bytes(self) -> int:
        """Bytes of every retained version (the pending one not included)."""
        return sum(self._versions.values())

    @property
    def used_bytes(self) -> int:
        """Bytes held now: retained plus pending."""
        return self.retained_bytes + self.pending

    def bytes_of(self, version: int) -> int:
        """Bytes of a retained version."""
        return self._versions[version]

    def pinned(self, version: int) -> bool:
        """Whether a transfer holds ``version``."""
        return self._pins[version] > 0

    # --- the pending version ----------------------------------------------------------

    def reserve(self, nbytes: int) -> Room:
        """Ask for ``nbytes`` more for the pending version.

        Evicts the oldest unpinned versions while the bytes would not fit; the newest is
        never evicted for room (late joiners are served from it while the next arrives),
        so ``max_bytes`` must hold the newest version beside the one arriving: a version
        that cannot is a :class:`UsageError`. When the bytes fit, they count as pending
        from now on; when not (every older version pinned), nothing is reserved and the
        caller waits for an :meth:`unpin` and asks again.
        """
        if nbytes < 0:
            raise ValueError("nbytes must not be negative")
        limit = self.policy.max_bytes
        if limit is None:
            self.pending += nbytes
            return Room((), fits=True)
        newest = self.newest
        kept = 0 if newest is None else self._versions[newest]
        if self.pending + nbytes + kept > limit:
            raise UsageError(
                f"a version of more than {self.pending + nbytes} bytes cannot be retained "
                f"beside the newest ({kept} bytes) within max_bytes {limit}"
            )
        evict: list[int] = []
        free = limit - self.used_bytes
        for version in list(self._versions)[:-1]:
            if free >= nbytes:
                break
            if self._pins[version]:
                continue
            free += self._versions.pop(version)
            evict.append(version)
        if free < nbytes:
            return Room(tuple(evict), fits=False)
        self.pending += nbytes
        return Room(tuple(evict), fits=True)

    def abort(self) -> None:
        """The pending version was dropped: its bytes are free."""
        self.pending = 0

    def commit(self, version: int) -> tuple[int, ...]:
        """The pending version is retained as ``version``; returns versions evicted by count."""
        if version in self._versions:
            raise UsageError(f"version {version} is already retained")
        self._versions[version] = self.pending
        self.pending = 0
        return self._trim()

    def _trim(self) -> tuple[int, ...]:
        """Evict the oldest unpinned versions beyond the count (never the newest)."""
        evict: list[int] = []
        extra = len(self._versions) - self.policy.max_versions
        for version in list(self._versions)[:-1]:
            if extra <= 0:
                break
            if not self._pins[version]:
                del self._versions[version]
                evict.append(version)
                extra -= 1
        return tuple(evict)

    # --- pins -------------------------------------------------------------------------

    def pin(self, version: int) -> bool:
        """Hold ``version`` for a transfer; False when it is not retained."""
        if version not in self._versions:
            return False
        self._pins[version] += 1
        return True

    def unpin(self, version: int) -> tuple[int, ...]:
        """Release one hold; returns versions that may now be evicted by count."""
        if self._pins[version] <= 0:
            raise UsageError(f"version {version} is not pinned")
        self._pins[version] -= 1
        if not self._pins[version]:
            del self._pins[version]
        return self._trim()
