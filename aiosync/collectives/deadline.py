"""A point in time by which a whole sync must finish (see :mod:`aiosync.collectives.executor`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Deadline:
    """A point in time (monotonic clock) that a whole sync must finish by."""

    seconds: float
    end: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"a deadline must be positive, got {self.seconds}")
        if self.end == 0.0:
            object.__setattr__(self, "end", time.monotonic() + self.seconds)

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline ``seconds`` from now."""
        return cls(seconds)

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.end
