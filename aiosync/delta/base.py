"""The trainer's base store: the versions it diffs each engine's next version against.

A delta needs, on the trainer, the bytes of the version the engine holds: the last one the
engine committed. :class:`BaseStore` keeps up to ``versions`` such copies (engines on the
same version share one), on the tensors' own device or in host memory (pinned where CUDA
is present), as the user chooses. Like a staged copy, the memory is stated and checked
before anything is allocated: :meth:`BaseStore.reserve` raises if it does not fit. Keeping
bases is off by default (:class:`BaseConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from aiosync.core.errors import AiosyncError, MismatchError, UsageError
from aiosync.delta.digest import VersionDigest
from aiosync.engine.staging import free_bytes

Keep = Literal["off", "device", "host"]
KEEPS: tuple[Keep, ...] = ("off", "device", "host")


@dataclass(frozen=True)
class BaseConfig:
    """Whether and where a trainer keeps bases, and how many distinct versions at most.

    ``keep``: "off" (the default), "device" (the tensors' own) or "host".
    """

    keep: Keep = "off"
    versions: int = 1

    def store(self, *, key: int = 0) -> BaseStore | None:
        """The store this asks for, or None when off."""
        if self.keep not in KEEPS:
            raise ValueError(f"keep must be one of {KEEPS}, got {self.keep!r}")
        if self.keep == "off":
            return None
        return BaseStore(self.keep, versions=self.versions, key=key)


@dataclass(frozen=True)
class Base:
    """A version as the store holds it: its number, its tensors (in order), their digest.

    The digest is :class:`~aiosync.delta.digest.VersionDigest`'s, as hex.
    """

    version: int
    tensors: Mapping[str, torch.Tensor]
    digest: str


class BaseStore:
    """Copies of the versions engines hold, ``versions`` slots at most, each a whole version.

    :meth:`reserve` allocates every slot; :meth:`keep` copies a version into one (reusing
    the slot no engine holds, else the oldest: its engines then have no base and are sent
    the whole version); :meth:`committed` records which version an engine holds.
    """

    def __init__(self, keep: Literal["device", "host"], *, versions: int = 1, key: int = 0):
        if keep not in ("device", "host"):
            raise ValueError(f"keep must be 'device' or 'host', got {keep!r}")
        if versions < 1:
            raise ValueError(f"versions must be at least 1, got {versions}")
        self.keep_on, self.versions, self.key = keep, versions, key
        self._slots: list[dict[str, torch.Tensor]] = []
        self._held: list[Base | None] = []  # per slot
        self._engines: dict[str, int] = {}  # engine -> version it committed
        self._newest: int | None = None

    def _place(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device if self.keep_on == "device" else torch.device("cpu")

    def needed_bytes(self, tensors: Mapping[str, torch.Tensor]) -> dict[torch.device, int]:
        """Bytes the store takes for a version of ``tensors``, per device, all slots."""
        needed: dict[torch.device, int] = {}
        for tensor in tensors.values():
            place = self._place(tensor)
            needed[place] = needed.get(place, 0) + tensor.nbytes * self.versions
        return needed

    @property
    def nbytes(self) -> int:
        """Bytes the store holds now."""
        return sum(t.nbytes for slot in self._slots for t in slot.values())

    def reserve(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Allocate every slot for versions of ``tensors``' names, dtypes and shapes.

        :class:`AiosyncError` (nothing allocated) if a device's free memory is less than
        the store needs there; reserving again drops every base held.
        """
        needed = self.needed_bytes(tensors)
        held = {d: 0 for d in needed}
        for slot in self._slots:
            for t in slot.values():
                held[t.device] = held.get(t.device, 0) + t.nbytes
        for device, count in needed.items():
            free = free_bytes(device)
            if free is not None and count > free + held.get(device, 0):
                raise AiosyncError(
                    f"keeping {self.versions} base version(s) needs {count:,} bytes on"
                    f" {device} ({count / 2**30:,.2f} GiB) but only {free:,} bytes"
                    f" ({free / 2**30:,.2f} GiB) are free; keep fewer versions, keep them"
                    " on another device, or send dense versions only"
                )
        self._slots.clear()
        self._held.clear()
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors.values())
        for _ in range(self.versions):
            self._slots.append(
                {
                    name: torch.empty(
                        t.shape,
                        dtype=t.dtype,
                        device=self._place(t),
                        pin_memory=pin and self._place(t).type == "cpu",
                    )
                    for name, t in tensors.items()
                }
            )
            self._held.append(None)

    def _slot_for(self, version: int) -> int:
        for i, held in enumerate(self._held):
            if held is not None and held.version == version:
                return i
        in_use = set(self._engines.values()) | {self._newest}
        oldest: tuple[int, int] | None = None  # (version, slot)
        for i, held in enumerate(self._held):
            if held is None or held.version not in in_use:
                return i
            if oldest is None or held.version < oldest[0]:
                oldest = (held.version, i)
        assert oldest is not None
        return oldest[1]

    def keep(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Base:
        """Copy ``tensors`` (the version as sent, in manifest order) into a slot.

        The copies are queued on the tensors' streams: change the tensors in place only
        after them (a later operation on the same stream is). :class:`MismatchError` if
        the names, dtypes or shapes differ from those reserved.
        """
        if not self._slots:
            raise UsageError("reserve the base store before keeping a version")
        index = self._slot_for(version)
        held = self._held[index]
        if held is not None and held.version == version:
            self._newest = version
            return held
        slot = self._slots[index]
        if list(slot) != list(tensors):
            raise MismatchError(f"version {version}'s tensors are not those the store reserved")
        digest = VersionDigest(key=self.key)
        for name, tensor in tensors.items():
            copy = slot[name]
            if copy.dtype != tensor.dtype or copy.shape != tensor.shape:
                raise MismatchError(
                    f"{tensor.dtype}{list(tensor.shape)}, reserved as"
                    f" {copy.dtype}{list(copy.shape)}",
                    tensor=name,
                    version=version,
                )
        self._held[index] = None  # its old version is gone from here on
        for name, tensor in tensors.items():
            slot[name].copy_(tensor, non_blocking=True)
            digest.update(tensor)
        base = Base(version, slot, digest.hexdigest())
        self._held[index] = base
        self._newest = version
        return base

    def committed(self, engine: str, version: int) -> None:
        """``engine`` now holds ``version`` (made live there)."""
        self._engines[engine] = version

    def forget(self, engine: str) -> None:
        """``engine`` left the fleet or lost its weights: it has no base."""
        self._engines.pop(engine, None)

    def base_for(self, engine: str) -> Base | None:
        """The base to diff ``engine``'s next version against, or None (send it dense)."""
        version = self._engines.get(engine)
        for held in self._held:
            if held is not None and held.version == version:
                return held
        return None
