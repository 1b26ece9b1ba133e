"""A store view that lets several ranks of one group live in one process.

torch keeps one registry of group names per process, and a group's rendezvous keys sit
under ``"<group_name>/"`` in its store (``_new_process_group_helper`` adds that prefix).
Two ranks of one group in one process (an engine spanning two GPUs, or an engine object in
the trainer's process) therefore cannot both use the group's name. :class:`AliasStore`
lets a rank register under a name of its own (``"<group>~r<rank>"``) while its keys land
where the other ranks' do: it rewrites the alias's prefix to the group's on every key.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from torch._C._distributed_c10d import Store


def rank_alias(group_name: str, rank: int) -> str:
    """The per-process name rank ``rank`` of ``group_name`` registers under."""
    return f"{group_name}~r{rank}"


class AliasStore(Store):
    """``inner`` with keys under ``alias + "/"`` moved to ``group_name + "/"``."""

    def __init__(self, inner: Store, alias: str, group_name: str) -> None:
        super().__init__()
        self._inner = inner
        self._old = f"{alias}/"
        self._new = f"{group_name}/"

    def _key(self, key: str) -> str:
        return self._new + key[len(self._old) :] if key.startswith(self._old) else key

    def set(self, key: str, value: str) -> None:  # type: ignore[override]
        """Set ``key`` (rewritten)."""
        self._inner.set(self._key(key), value)

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """Get ``key`` (rewritten)."""
        return self._inner.get(self._key(key))

    def add(self, key: str, value: int) -> int:  # type: ignore[override]
        """Add to counter ``key`` (rewritten)."""
        return self._inner.add(self._key(key), value)

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str, desired_value: str
    ) -> bytes:
        """Compare-and-set ``key`` (rewritten)."""
        return self._inner.compare_set(self._key(key), expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        """Wait for ``keys`` (rewritten)."""
        moved = [self._key(key) for key in keys]
        if timeout is None:
            self._inner.wait(moved)
        else:
            self._inner.wait(moved, timeout)

    def check(self, keys: Sequence[str]) -> bool:  # type: ignore[override]
        """True when all ``keys`` (rewritten) exist."""
        return self._inner.check([self._key(key) for key in keys])

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        """Delete ``key`` (rewritten)."""
        return self._inner.delete_key(self._key(key))

    def num_keys(self) -> int:  # type: ignore[override]
        """Keys in the inner store."""
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        """Set the inner store's timeout."""
        self._inner.set_timeout(timeout)
