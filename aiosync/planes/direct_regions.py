"""Where a trainer's tensor lives, as a region an engine can read directly (direct mode).

A region is one block of trainer memory exported once: on CUDA the ``cudaMalloc``
allocation that holds the tensor (found with the driver's pointer attributes, exported with
a legacy ``cudaIpcGetMemHandle`` handle); on the CPU the shared segment
:func:`~aiosync.planes.shared_tensors.share_tensors` placed it in. :meth:`RegionFinder.locate`
answers a :class:`Spot` (region, key, offset) or, for a tensor that must be packed, the
reason why, which the sender's report sums up.

CUDA allocations are cached by the driver's buffer id (unique per allocation in the
process): a tensor moved to new memory is found in its new allocation, exported then, and
an allocation freed and made again at the same address has a new id and a new export.
Memory from expandable segments (``cuMemCreate``) has no legacy handle: such a tensor's
region is the run of physical allocations it lies in, which engines map from file
descriptors the trainer passes them (:mod:`aiosync.planes.fd_regions`), where the plane
has a descriptor socket; else it is packed.

Whether a region found before still holds a tensor at the same address is one driver query
(:meth:`RegionFinder.still`, about 5 µs). :meth:`RegionFinder.marker` and
:meth:`RegionFinder.allocator_owned` let a sender skip it where it is provably unneeded:

- a region that was, when found, a whole segment of torch's caching allocator on this
  device (its base is a segment's address in ``torch.cuda.memory_snapshot()``) is released
  only by that allocator's ``release_block`` (``cudaFree``: ``empty_cache``, an allocation
  retrying after an out-of-memory, the garbage-collection threshold, a freed private pool),
  which counts in ``memory_stats``' ``segment.all.freed`` and ``num_device_free``;
- so while the marker (those counters, read *before* the region was last found or checked)
  is unchanged, the region is still live at its base and size, and a tensor whose
  ``data_ptr`` (and extent) is the one it had then is still inside it: live allocations do
  not overlap. What happened to the tensor object in between (``set_``, ``.data =``, its
  storage resized to 0 and back as FSDP does, a new storage at the same address) does not
  matter: the address alone is what is checked;
- the tensor's own identity is not enough without the marker: a storage resized to 0 and
  back, or a ``set_`` to a new storage, after ``empty_cache`` released the old segment, can
  land at the same address in a new ``cudaMalloc`` (same object, same ``data_ptr``, same
  size, even the same storage object), whose export is another handle;
- the counters can be reset (``torch.cuda.reset_accumulated_memory_stats``). Since every
  change to ``current`` changes ``allocated`` or ``freed`` with it, ``current ==
  allocated - freed`` holds unless a reset happened while a segment existed: the marker is
  None then (no skipping, for the rest of the process). What it cannot see is a reset
  while the device held no segment at all (so not the region either) followed by exactly
  as many segment allocations and frees as before the reset: then a region is checked
  only when the tensor's address, dtype or shape changed;
- a descriptor region inside one of the allocator's expandable segments (within a mapped
  range the snapshot reports) is vouched for the same way: that allocator maps a page into
  a segment only where none is (``map_block``, counted in ``num_device_alloc``) and unmaps
  one only in ``unmap_block`` (counted in ``num_device_free``), so while those counters are
  unchanged each page a region named is still the physical allocation it was;
- memory not from the caching allocator (``cudaMalloc`` by another library, the allocator
  disabled, a pluggable allocator, ``cudaMallocAsync``, CPU segments) is never vouched
  for: it is checked every version, as is everything where the stats or the snapshot
  cannot be read.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from aiosync.core.layout import ALIGNMENT, is_plain
from aiosync.core.plane_specs import CudaFdRegion
from aiosync.core.wire import CudaRegion, Region
from aiosync.planes.cuda_runtime import driver
from aiosync.planes.shared_tensors import find_shared

if TYPE_CHECKING:
    from aiosync.planes.fd_regions import FdRegions, Pieces

# CUpointer_attribute values (cuda.h)
_ATTR_BUFFER_ID = 7
_ATTR_LEGACY_IPC = 10
_ATTR_RANGE_START = 11
_ATTR_RANGE_SIZE = 12

NOT_EXPORTABLE = "its memory has no legacy CUDA IPC handle (expandable segments?)"
"""Why a CUDA tensor is packed when its allocation cannot be exported (the report's note)."""
MISALIGNED = f"not {ALIGNMENT}-byte aligned in its allocation"
NOT_PLAIN = "not contiguous"


@dataclass(frozen=True)
class Spot:
    """A tensor's place: ``region`` (as engines get it), its ``key`` here, the offset."""

    region: Region
    key: object
    offset: int


def address_range(pointer: int) -> tuple[int, int] | None:
    """The base and size of the allocation (or mapping) holding device ``pointer``."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    code = driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer)
    return None if code != 0 else (base.value, size.value)


class _Scratch:
    """The ctypes arguments of one attribute query, made once (a finder's, one thread)."""

    def __init__(self) -> None:
        self.values = [ctypes.c_uint64(0) for _ in range(4)]
        self.kinds = (ctypes.c_int * 4)(
            _ATTR_RANGE_START, _ATTR_RANGE_SIZE, _ATTR_BUFFER_ID, _ATTR_LEGACY_IPC
        )
        self.data = (ctypes.c_void_p * 4)(*(ctypes.addressof(v) for v in self.values))


def _attributes(pointer: int, scratch: _Scratch) -> tuple[int, int, int, bool] | None:
    """(base, size, buffer id, legacy-IPC capable) of the allocation holding ``pointer``."""
    values = scratch.values
    for value in values:
        value.value = 0
    if driver().cuPointerGetAttributes(4, scratch.kinds, scratch.data, pointer) != 0:
        return None
    return values[0].value, values[1].value, values[2].value, bool(values[3].value & 0xFF)


class RegionFinder:
    """Finds tensors' regions on ``device`` (a trainer's, for its sender's direct plane).

    ``descriptors``: the plane's descriptor regions, for CUDA memory without a legacy
    handle (None: such tensors are packed).
    """

    def __init__(self, device: torch.device, descriptors: FdRegions | None = None) -> None:
        self.device = device
        self._exports: dict[int, CudaRegion | None] = {}  # buffer id -> region (None: refused)
        self._bases: dict[object, int] = {}  # buffer id -> the allocation's base address
        self._extents: dict[object, tuple[int, int]] = {}  # descriptor region -> its span
        self._descriptors = descriptors
        self._scratch = _Scratch()

    def locate(self, tensor: torch.Tensor) -> Spot | str:
        """Where ``tensor`` lies, or why it cannot be read in place (it is then packed)."""
        if tensor.device != self.device:
            return f"on {tensor.device}, not {self.device}"
        if not is_plain(tensor):
            return NOT_PLAIN
        if tensor.device.type == "cpu":
            spot = find_shared(tensor)
            if spot is None:
                return "not in a shared segment (aiosync.share_tensors)"
            if spot.offset % ALIGNMENT:
                return MISALIGNED
            return Spot(spot.handle, spot.handle.name, spot.offset)
        return self._locate_cuda(tensor)

    def _locate_cuda(self, tensor: torch.Tensor) -> Spot | str:
        pointer = tensor.data_ptr()
        found = _attributes(pointer, self._scratch)
        if found is None or not found[3]:
            return self._locate_fd(tensor)
        base, size, buffer_id, _ = found
        if buffer_id not in self._exports:
            self._exports[buffer_id] = _export(base, size)
            self._bases[buffer_id] = base
        region = self._exports[buffer_id]
        if region is None:
            return NOT_EXPORTABLE
        offset = pointer - base
        if offset % ALIGNMENT:
            return MISALIGNED
        if offset + tensor.nbytes > region.size:
            return "runs past its allocation"
        return Spot(region, buffer_id, offset)

    def _locate_fd(self, tensor: torch.Tensor) -> Spot | str:
        """The descriptor region of a tensor whose memory has no legacy handle."""
        if self._descriptors is None:
            return NOT_EXPORTABLE
        found = self._descriptors.locate(tensor.data_ptr(), tensor.nbytes)
        if isinstance(found, str):
            return found
        region, pieces, offset = found
        if offset % ALIGNMENT:
            return MISALIGNED
        self._extents[pieces] = (pieces[0].base, pieces[-1].base + pieces[-1].size)
        return Spot(region, pieces, offset)

    def still(self, tensor: torch.Tensor, spot: Spot) -> bool:
        """Whether ``tensor`` (found at ``spot`` before, same address) is still in that region."""
        if tensor.device.type == "cpu":
            found = find_shared(tensor)
            return found is not None and found.handle == spot.region
        if isinstance(spot.region, CudaFdRegion):
            fd = self._descriptors
            return fd is not None and fd.still(cast("Pieces", spot.key))
        found_cuda = _attributes(tensor.data_ptr(), self._scratch)
        return found_cuda is not None and found_cuda[2] == spot.key

    def marker(self) -> tuple[int, ...] | None:
        """Counters that change whenever the caching allocator may have released a segment.

        Those of this device (None: no such signal; check every region each version). Read
        it *before* the lookups it is to vouch for (see the module's docstring).
        """
        if self.device.type != "cuda":
            return None
        try:
            stats = self._stats()
        except Exception:  # a pluggable allocator, an old torch: no signal
            return None
        return allocator_marker(stats)

    def allocator_owned(self, keys: Iterable[object]) -> set[object]:
        """Those of ``keys`` (found regions) that are caching allocator segments.

        Whole segments of torch's caching allocator on this device, so that :meth:`marker`
        vouches for them (one ``torch.cuda.memory_snapshot()``).
        """
        keys = set(keys)
        wanted = {key: self._bases[key] for key in keys if key in self._bases}
        spans = {key: self._extents[key] for key in keys if key in self._extents}
        if not (wanted or spans) or self.device.type != "cuda":
            return set()
        try:
            bases = self._segment_bases() if wanted else frozenset()
            ranges = self._expandable_ranges() if spans else []
        except Exception:  # the snapshot is not available with this allocator
            return set()
        owned = {key for key, base in wanted.items() if base in bases}
        return owned | {key for key, span in spans.items() if within(ranges, *span)}

    def _stats(self) -> Mapping[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict`` of this device (tests replace it)."""
        return torch.cuda.memory_stats_as_nested_dict(self.device)

    def _segment_bases(self) -> frozenset[int]:
        """Addresses of the caching allocator's segments on this device (tests replace it)."""
        if torch.cuda.memory.get_allocator_backend() != "native":
            return frozenset()
        index = self.device.index if self.device.index is not None else 0
        snapshot = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        return segment_bases(snapshot, index)

    def _expandable_ranges(self) -> list[tuple[int, int]]:
        """The allocator's mapped expandable ranges on this device (tests replace it)."""
        if torch.cuda.memory.get_allocator_backend() != "native":
            return []
        index = self.device.index if self.device.index is not None else 0
        snapshot = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        return expandable_ranges(snapshot, index)

    def retain(self, keys: Iterable[object]) -> None:
        """Keep serving only the descriptor regions of ``keys`` (a fresh split's)."""
        kept = set(keys)
        self._extents = {key: span for key, span in self._extents.items() if key in kept}
        if self._descriptors is not None:
            self._descriptors.retain(kept)

    def clear(self) -> None:
        """Forget every export (a closing sender)."""
        self._exports.clear()
        self._bases.clear()
        self._extents.clear()


def allocator_marker(stats: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The segment counters of nested ``stats``; None if they are missing or were reset.

    ``segment.all``'s ``allocated`` and ``freed`` with the device alloc and free calls;
    ``current != allocated - freed`` means the accumulated counters were reset while a
    segment existed, after which they no longer count every release.
    """
    try:
        segment = stats["segment"]["all"]
        allocated, freed, current = (int(segment[k]) for k in ("allocated", "freed", "current"))
        calls = (int(stats.get("num_device_alloc", 0)), int(stats.get("num_device_free", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    if current != allocated - freed:
        return None
    return (allocated, freed, *calls)


def segment_bases(snapshot: Sequence[Mapping[str, Any]], device: int) -> frozenset[int]:
    """The base addresses of the non-expandable segments on ``device`` in a snapshot."""
    return frozenset(
        int(segment["address"])
        for segment in snapshot
        if segment.get("device") == device and not segment.get("is_expandable", False)
    )


def expandable_ranges(snapshot: Sequence[Mapping[str, Any]], device: int) -> list[tuple[int, int]]:
    """The mapped ranges of expandable segments on ``device`` in a snapshot, in order.

    torch reports one segment a contiguous mapped range of an expandable segment.
    """
    return sorted(
        (int(segment["address"]), int(segment["address"]) + int(segment["total_size"]))
        for segment in snapshot
        if segment.get("device") == device and segment.get("is_expandable", False)
    )


def within(ranges: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside one of the sorted, disjoint ``ranges``."""
    at = bisect.bisect_right(ranges, start, key=lambda r: r[0]) - 1
    return at >= 0 and ranges[at][0] <= start and end <= ranges[at][1]


def _export(base: int, size: int) -> CudaRegion | None:
    """The legacy IPC handle of the allocation at ``base``; None where CUDA refuses one."""
    from aiosync.planes.cuda_runtime import IPC_HANDLE_BYTES, IpcHandle, runtime

    handle = IpcHandle()
    lib = runtime()
    if lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)) != 0:
        lib.cudaGetLastError()  # clear it: torch's next launch check would raise it
        return None
    raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)
    return CudaRegion(raw, size)
