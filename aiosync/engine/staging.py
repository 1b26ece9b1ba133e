"""The staged copy of a :class:`~aiosync.ModuleSink`'s weights, and how it goes live.

A staged sink writes each version into shadow tensors, one per storage (tied names share
one), and makes them live at commit in one of two ways:

* ``"copy"`` copies each written shadow into the live tensor: the live tensors never move,
  which engines that captured CUDA graphs or hold raw pointers need.
* ``"pointer"`` makes the shadow's storage the live tensor's (``tensor.data = shadow``, for
  every name of a tied tensor, so they stay tied), and the old live storage becomes that
  name's next shadow: no second copy and no allocation per version. A live tensor whose
  storage is shared with anything but its own names (a view of a larger buffer, a
  ``state_dict()`` copy of a module's parameter, a view someone keeps) is copied instead,
  so nothing outside the sink is ever left pointing at a staging area.

:meth:`Staging.reserve` allocates every shadow up front after checking that it fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from aiosync.core.errors import AiosyncError

Swap = Literal["copy", "pointer"]
SWAPS: tuple[Swap, ...] = ("copy", "pointer")


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (None: unknown, not checked).

    CUDA: ``torch.cuda.mem_get_info``; CPU: available memory, or the cgroup's headroom if
    less (:func:`~aiosync.planes.memfd.memory_free`).
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        from aiosync.planes.memfd import memory_free  # not loaded by sinks that never stage

        return memory_free()
    return None


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # (private) None: never swap


def _holders(storage: torch.UntypedStorage) -> int | None:
    """How many tensors hold ``storage``, less the caller's storage object (None: unknown)."""
    return None if _USE_COUNT is None else int(_USE_COUNT(storage._cdata)) - 1


class Staging:
    """Shadows of ``targets`` (engine name -> live tensor), keyed by their first name."""

    def __init__(self, targets: Mapping[str, torch.Tensor], swap: Swap) -> None:
        if swap not in SWAPS:
            raise ValueError(f"swap must be one of {SWAPS}, got {swap!r}")
        self.swap = swap
        self.owner: dict[str, str] = {}  # every name -> the first name of its tensor
        self.members: dict[str, list[torch.Tensor]] = {}  # first name -> distinct tensors
        first_at: dict[tuple[int, str, tuple[int, ...], tuple[int, ...]], str] = {}
        for name, tensor in targets.items():
            key = (tensor.data_ptr(), str(tensor.device), tuple(tensor.shape), tensor.stride())
            empty = tensor.device.type == "meta" or tensor.numel() == 0
            owner = name if empty else first_at.setdefault(key, name)
            self.owner[name] = owner
            group = self.members.setdefault(owner, [])
            if not any(t is tensor for t in group):
                group.append(tensor)
        self.shadow: dict[str, torch.Tensor] = {}
        self.pending: set[str] = set()
        # pointer swap, per key: the live StorageImpl this sink placed (kept alive by the
        # standby tensor beside it, which becomes the next shadow) and the shadow's
        # StorageImpl; while the live tensor still has that storage, its layout is known
        self._placed: dict[str, list[Any]] = {}  # [live StorageImpl, standby, shadow's]

    def write(self, name: str) -> tuple[str, torch.Tensor]:
        """The key and shadow that ``name`` is written into this version (made if missing)."""
        key = self.owner[name]
        self.pending.add(key)
        return key, self._shadow(key)

    def _shadow(self, key: str) -> torch.Tensor:
        shadow = self.shadow.get(key)
        if shadow is None:
            live = self.members[key][0]
            shadow = torch.empty(live.shape, dtype=live.dtype, device=live.device)
            self.shadow[key] = shadow
        return shadow

    @property
    def extra_bytes(self) -> int:
        """Bytes the shadows hold."""
        return sum(shadow.nbytes for shadow in tuple(self.shadow.values()))

    def reserve(self) -> None:
        """Allocate every shadow now; :class:`AiosyncError` if they do not fit in free memory."""
        missing = [key for key in self.members if key not in self.shadow]
        needed: dict[torch.device, int] = {}
        for key in missing:
            live = self.members[key][0]
            needed[live.device] = needed.get(live.device, 0) + live.nbytes
        for device, count in needed.items():
            free = free_bytes(device)
            if free is not None and count > free:
                raise AiosyncError(
                    f"staging a second copy of the weights needs {count:,} bytes on {device}"
                    f" ({count / 2**20:,.1f} MiB) but only {free:,} bytes"
                    f" ({free / 2**20:,.1f} MiB) are free; free memory or use an in-place"
                    " sink (staged=False)"
                )
        for key in missing:
            self._shadow(key)

    def _movable(self, key: str) -> bool:
        """Whether ``key``'s live storage may move: exactly its tensor, held by its names only.

        Once this sink made a storage live, its layout is known (a shadow it allocated) and
        only the holders are counted: a few calls into torch per tensor.
        """
        group = self.members[key]
        live = group[0]
        placed = self._placed.get(key)
        storage = live.untyped_storage()  # held while counting: its holders count it once
        if placed is not None and placed[0] == storage._cdata:  # a storage this sink placed
            return bool(_holders(storage) <= len(group) + 1)  # type: ignore[operator]
        shadow = self.shadow[key]
        if live.is_meta or live.storage_offset() != 0:
            return False
        if not (live.is_contiguous() and shadow.is_contiguous()):
            return False
        if storage.nbytes() != live.nbytes or live.nbytes == 0:
            return False
        holders = _holders(storage)
        if holders is None or holders > len(group):
            self._placed.pop(key, None)
            return False
        # from now on: [the live storage, a tensor holding it, the shadow's storage]
        self._placed[key] = [storage._cdata, live.data, shadow.untyped_storage()._cdata]
        return True

    def commit(self, *, pointers_only: bool = False) -> list[str] | None:
        """Make every shadow written since the last commit live; returns the keys that moved.

        A moved key's shadow is now the storage that was live (its cached views are stale).
        ``pointers_only``: do nothing and return None unless every written shadow can go
        live by pointer (the receiver then commits on its event loop: no bytes move).
        """
        moves: list[str] = []
        copies: list[str] = []
        pointer = self.swap == "pointer"
        for key in self.pending:
            if pointer and self._movable(key):
                moves.append(key)
            elif pointers_only:
                return None
            else:
                copies.append(key)
        shadows, placed, members = self.shadow, self._placed, self.members
        for key in moves:  # the shadow's storage becomes the live one; and back
            shadow, slot = shadows[key], placed[key]
            for tensor in members[key]:
                tensor.data = shadow
            shadows[key] = slot[1]
            slot[0], slot[1], slot[2] = slot[2], shadow, slot[0]
        for key in copies:
            self.members[key][0].data.copy_(shadows[key], non_blocking=True)
        self.pending.clear()
        return moves

    def abort(self) -> None:
        """Forget what was written since the last commit (nothing live was touched)."""
        self.pending.clear()
