"""Read leases: requests pin the weights they read; a new version goes live between them.

Readers hold leases (:meth:`LeaseGate.lease`) for as long as they read the weights; making a
version live takes the gate exclusively (:meth:`LeaseGate.exclusive`), which waits until no
lease is held. Once a swap is waiting, new leases wait for it, so a steady stream of requests
cannot starve updates; the swap's wait is bounded, and past the bound it gives up (the
version is refused, the weights stay as they were).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from aiosync.core.errors import SyncTimeoutError


class LeaseGate:
    """Many readers or one swap at a time; a waiting swap goes before new readers."""

    def __init__(self) -> None:
        self.readers = 0
        self.swap_pending = False
        self.longest_wait = 0.0  # seconds a swap waited for readers, the longest so far
        self._changed = anyio.Event()

    async def changed(self) -> None:
        """Return at the next change: a lease taken or released, a swap pending or done."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @asynccontextmanager
    async def lease(self, timeout: float) -> AsyncIterator[None]:
        """Hold the weights steady for one reader (waits for a pending swap first)."""
        with anyio.move_on_after(timeout) as scope:
            while self.swap_pending:
                await self._changed.wait()
        if scope.cancelled_caught:
            raise SyncTimeoutError(f"a swap of the weights took more than {timeout:g}s")
        self.readers += 1
        try:
            yield
        finally:
            self.readers -= 1
            self._notify()

    @asynccontextmanager
    async def exclusive(self, timeout: float) -> AsyncIterator[None]:
        """Wait (at most ``timeout`` seconds) until no lease is held, then hold the gate."""
        self.swap_pending = True
        self._notify()
        started = anyio.current_time()
        try:
            with anyio.move_on_after(timeout) as scope:
                while self.readers:
                    await self._changed.wait()
            self.longest_wait = max(self.longest_wait, anyio.current_time() - started)
            if scope.cancelled_caught:
                raise SyncTimeoutError(
                    f"{self.readers} read leases still held after {timeout:g}s; "
                    "the new version was not made live"
                )
            yield
        finally:
            self.swap_pending = False
            self._notify()
