"""Which engines still read which buffer: a buffer is free once every live engine acked it."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class BufferLedger(Generic[T]):
    """Holds of engines on buffers, with what each held buffer carries (pure, no IO)."""

    def __init__(self) -> None:
        self._holds: dict[int, tuple[set[Hashable], T]] = {}

    def hold(self, index: int, engines: Iterable[Hashable], item: T) -> None:
        """Buffer ``index`` now carries ``item``, to be read by every one of ``engines``."""
        if index in self._holds:
            raise RuntimeError(f"buffer {index} is still held")
        self._holds[index] = (set(engines), item)

    def release(self, index: int, engine: Hashable) -> T | None:
        """``engine`` is done with buffer ``index``; its item once no engine holds it."""
        holders, item = self._holds[index]
        holders.discard(engine)
        if holders:
            return None
        del self._holds[index]
        return item

    def drop(self, engine: Hashable) -> list[tuple[int, T]]:
        """``engine`` is gone: release all its holds; the buffers (and items) now free."""
        freed = []
        for index in list(self._holds):
            holders, item = self._holds[index]
            if engine in holders:
                released = self.release(index, engine)
                if released is not None:
                    freed.append((index, item))
        return freed

    @property
    def held(self) -> int:
        """Buffers some engine still reads."""
        return len(self._holds)
