"""Direct mode: engines copy a trainer's persistent tensors straight out of its memory.

A direct plane is a ring plane (:mod:`aiosync.planes.shm` or :mod:`aiosync.planes.cuda`,
which still carries every temporary: casts, gathered tensors) plus one more
buffer index, the direct one. A bucket there is a :class:`DirectPlan`: no bytes are packed;
it names its regions (blocks of trainer memory, :mod:`aiosync.planes.direct_regions`) and
its specs' offsets run through those regions in order, each region taking its size rounded
up to :data:`~aiosync.core.layout.ALIGNMENT`. The engine checks the specs against the
bucket's bytes as for any bucket, then :meth:`DirectReceiverPlane.parts` checks the regions
(kind, count, sizes, that they add up to the bucket and that no tensor crosses a region's
end), opens each new one once (read-only memfd maps on the CPU; legacy IPC handles on CUDA,
whose mapped size is checked against the claim, or, for memory without one, the physical
allocations whose file descriptors the trainer passes over its socket:
:mod:`aiosync.planes.fd_regions`) and hands the sink one flat ``uint8`` view per region
with the specs rebased into it: the sink's apply path is unchanged.

Ordering on CUDA: the trainer records :attr:`~aiosync.core.wire.DirectPlaneSpec.
start_event` on its current stream as each version starts (after the step that made the
weights); each engine's stream waits on it before its copies. The trainer must not change
the tensors until engines have read them: a send returns only after the commit, which an
engine acknowledges after its one device wait per version, and the sender's ``packed``
event is set only then in a version with direct buckets.

Mappings are cached on both sides: the trainer's exports by allocation, the engine's opened
regions by handle, closing those a whole version did not use, and all at session end.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.layout import BucketPlan, TensorSpec, calculate_aligned_size
from aiosync.core.limits import Limits
from aiosync.core.plane_specs import CudaFdRegion, DescriptorSource
from aiosync.core.wire import (
    CudaPlaneSpec,
    CudaRegion,
    DirectPlaneSpec,
    Region,
    ShmHandle,
    ShmPlaneSpec,
)
from aiosync.planes.base import BucketContext, Part, ReceiverPlane, SenderPlane
from aiosync.planes.base import DirectPlan as DirectPlan  # its name here before it moved
from aiosync.planes.cuda_copies import wait_gate
from aiosync.planes.direct_regions import RegionFinder, address_range
from aiosync.planes.fd_regions import FdRegions, check_fd_region, open_fd_region, pieces_of
from aiosync.planes.rings import open_ring

log = logging.getLogger(__name__)

DIRECT_BYTES = 64 << 30
"""The most trainer memory one direct bucket may span (a larger region is packed)."""
MAX_REGIONS_PER_BUCKET = 1024
"""Regions one direct bucket may name (an engine refuses more)."""
MAX_OPEN_REGIONS = 4096
"""Regions an engine keeps open for one sender at once."""
MAX_OPEN_PIECES = 16384
"""Physical allocations an engine keeps mapped for one sender's descriptor regions at once."""


def _device_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device()


class DirectSenderPlane(SenderPlane):
    """``ring`` for packed buckets, plus direct buckets of the trainer's memory on ``device``."""

    def __init__(self, ring: SenderPlane, device: torch.device) -> None:
        self.ring = ring
        if device.type == "cuda":
            device = torch.device("cuda", _device_index(device))
        ring_spec = ring.spec
        if not isinstance(ring_spec, CudaPlaneSpec | ShmPlaneSpec):
            raise AiosyncError(f"direct mode cannot wrap a {type(ring_spec).__name__}")
        self._start: torch.cuda.Event | None = None
        self._descriptors: FdRegions | None = None
        handle = b""
        if device.type == "cuda":
            from aiosync.planes.cuda import new_event

            self._descriptors = FdRegions(_device_index(device))
            self._start, handle = new_event(_device_index(device))
        self.finder = RegionFinder(device, self._descriptors)
        source = None if self._descriptors is None else self._descriptors.source
        self._spec = DirectPlaneSpec(ring_spec, DIRECT_BYTES, handle, source)
        self._device = device

    @property
    def spec(self) -> DirectPlaneSpec:
        """The ring's spec, the direct bucket's bound and the start event's handle."""
        return self._spec

    @property
    def capacity(self) -> int:
        """Bytes of each ring buffer."""
        return self.ring.capacity

    @property
    def count(self) -> int:
        """Ring buffers (the direct index is this number)."""
        return self.ring.count

    def begin_version(self) -> None:
        """Pack on the caller's stream; engines' reads of its memory wait for this point."""
        self.ring.begin_version()
        if self._start is not None:
            self._start.record(torch.cuda.current_stream(self._device))

    def consumed(self, index: int, events: list[bytes]) -> None:
        """An engine acked ring buffer ``index`` (see the ring's ``consumed``)."""
        self.ring.consumed(index, events)

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Pack a ring bucket; a direct one has nothing to copy."""
        if not isinstance(plan, DirectPlan):
            self.ring.pack(index, plan)

    async def publish(self, index: int, used: int) -> None:
        """Publish a ring bucket (the pipeline skips direct ones)."""
        await self.ring.publish(index, used)

    def close(self) -> None:
        """Close the ring, stop serving descriptors and forget the exports (idempotent)."""
        self.ring.close()
        if self._descriptors is not None:
            self._descriptors.close()
        self.finder.clear()


@dataclass
class _Open:
    size: int
    tensor: torch.Tensor
    closer: Any
    used: int  # the last version that read it
    pieces: int = 0  # physical allocations mapped (a descriptor region)


@dataclass
class _Split:
    """One bucket's regions, checked and opened, and its specs split by them.

    Kept while the same spec list comes back with equal regions still open: the parts
    (the sink's (bytes, specs) pairs) are then handed out again as they are.
    """

    specs: list[TensorSpec]
    regions: list[Region]
    keys: list[Hashable]
    opened: list[_Open]
    parts: list[tuple[torch.Tensor, list[TensorSpec]]]
    used: int


class DirectReceiverPlane(ReceiverPlane):
    """An engine's ring plane plus the trainer regions its direct buckets name."""

    views_at_once = True  # a view never waits on the host (engine.quick_apply)

    def __init__(self, spec: DirectPlaneSpec, device: torch.device, limits: Limits | None) -> None:
        if spec.direct_bytes <= 0:
            raise AiosyncError(f"direct plane of {spec.direct_bytes} bytes")
        self._cuda = isinstance(spec.ring, CudaPlaneSpec)
        self._ring = open_ring(spec.ring, device, limits)
        self._direct = len(spec.ring.sizes)
        self._most = spec.direct_bytes
        self._max_bytes = min(spec.direct_bytes, (limits or Limits()).max_session_bytes)
        self._start: torch.cuda.Event | None = None
        self._source: DescriptorSource | None = None
        self._device = 0
        if isinstance(spec.ring, CudaPlaneSpec):
            self._source = spec.descriptors
            index = device.index if device.type == "cuda" and device.index is not None else None
            self._device = spec.ring.device if index is None else index
            if spec.start_event:
                from aiosync.planes.cuda import open_event

                try:
                    self._start = open_event(self._device, spec.start_event)
                except BaseException:
                    self._ring.close()
                    raise
        self._open: dict[Hashable, _Open] = {}
        self._splits: dict[int, _Split] = {}
        self._version: int | None = None
        self.events = list(self._ring.events)
        """The ring's engine events (CUDA), for the ready."""

    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        """A ring buffer's bytes; a direct bucket goes through :meth:`parts`."""
        if index == self._direct:
            raise ProtocolError("a direct bucket without its regions")
        return self._ring.view(index, used, context)

    def applied(self, index: int) -> None:
        """A ring bucket's copies are queued (the ring's event); nothing for direct ones."""
        if index < self._direct:
            self._ring.applied(index)

    def parts(
        self,
        index: int,
        used: int,
        specs: list[TensorSpec],
        regions: list[Region],
        version: int,
        context: BucketContext | None = None,
    ) -> list[Part]:
        """The bucket as (flat bytes, specs) pairs: one for a ring bucket, one per region.

        Raises :class:`ProtocolError` for regions that do not describe the bucket.
        """
        if version != self._version:  # also a ring bucket: a version may read no region
            self._next_version(version)
        if index != self._direct:
            if regions:
                raise ProtocolError(f"regions named for ring buffer {index}")
            return [(self.view(index, used, context), specs)]
        if not 0 < len(regions) <= MAX_REGIONS_PER_BUCKET:
            raise ProtocolError(
                f"direct bucket of {len(regions)} regions (1-{MAX_REGIONS_PER_BUCKET})"
            )
        kept = self._kept(specs, regions, version)
        if kept is None:
            kept = self._checked(used, specs, regions, version)
        if self._start is not None:
            wait_gate(torch.cuda.current_stream(self._device), self._start, context)
        if self._cuda and context is not None:
            context.graph = True  # the same reads every version while the split holds
        return kept.parts

    def _kept(self, specs: list[TensorSpec], regions: list[Region], version: int) -> _Split | None:
        """The split of a bucket seen before: the same spec list, equal regions, still open.

        Then nothing is checked or looked up again region by region (the session checked
        the specs; the regions compare equal to those checked when the split was made).
        """
        kept = self._splits.get(id(specs))
        if kept is None or kept.specs is not specs or kept.regions != regions:
            return None
        opened = self._open
        if any(opened.get(key) is not o for key, o in zip(kept.keys, kept.opened, strict=True)):
            return None
        for o in kept.opened:
            o.used = version
        kept.used = version
        return kept

    def _checked(
        self, used: int, specs: list[TensorSpec], regions: list[Region], version: int
    ) -> _Split:
        """Check a bucket's regions, open the new ones, split its specs by region."""
        starts: list[int] = []
        keys: list[Hashable] = []
        total = 0
        for region in regions:
            keys.append(self._check(region))
            starts.append(total)
            total += calculate_aligned_size(region.size)
        if len(set(keys)) != len(keys):
            raise ProtocolError("a region named twice in one bucket")
        if total != used:
            raise ProtocolError(f"regions of {total} bytes for a direct bucket of {used}")
        opened = [
            self._region(key, region, version) for key, region in zip(keys, regions, strict=True)
        ]
        grouped = self._split(specs, regions, starts)
        views = [o.tensor for o in opened]
        parts = [(view, group) for view, group in zip(views, grouped, strict=True) if group]
        split = _Split(specs, list(regions), keys, opened, parts, version)
        self._splits[id(specs)] = split
        return split

    def _split(
        self, specs: list[TensorSpec], regions: list[Region], starts: list[int]
    ) -> list[list[TensorSpec]]:
        """``specs`` by region, rebased (each list kept with its split while specs replay).

        Reusing the lists lets a sink reuse what it worked out for them (its copy programs).
        """
        sizes = [region.size for region in regions]
        grouped: list[list[TensorSpec]] = [[] for _ in regions]
        for spec in specs:
            k = bisect.bisect_right(starts, spec.offset) - 1
            local = spec.offset - starts[k]
            if k < 0 or local + spec.nbytes > sizes[k]:
                raise ProtocolError("bytes run past the end of their region", tensor=spec.name)
            grouped[k].append(msgspec.structs.replace(spec, offset=local))
        return grouped

    def _check(self, region: Region) -> Hashable:
        """A region's cache key, once its kind and size pass."""
        if not 0 < region.size <= self._max_bytes:
            raise ProtocolError(f"region of {region.size} bytes (most {self._max_bytes})")
        if self._cuda:
            if isinstance(region, CudaFdRegion):
                if self._source is None:
                    raise ProtocolError("a descriptor region from a trainer that named no socket")
                check_fd_region(region)
                return region  # its ident and pieces
            if not isinstance(region, CudaRegion) or len(region.handle) != 64:
                raise ProtocolError("a direct CUDA bucket names a region that is no CUDA handle")
            return region.handle
        from aiosync.planes.memfd import MEMFD_NAME

        if not isinstance(region, ShmHandle) or not MEMFD_NAME.fullmatch(region.name):
            raise ProtocolError("a direct CPU bucket names a region that is no sealed memfd")
        return region.name

    def _next_version(self, version: int) -> None:
        """A new version: close regions the whole last version did not read.

        "Did not read" is ``used != last``, not ``used < last``: numbers may go down (a
        rebase), and a region read only before it must close too.
        """
        last, self._version = self._version, version
        for at, split in list(self._splits.items()):
            if last is None or split.used != last:
                del self._splits[at]
        for key, opened in list(self._open.items()):
            if last is None or opened.used != last:
                del self._open[key]
                opened.closer()

    def _region(self, key: Hashable, region: Region, version: int) -> _Open:
        opened = self._open.get(key)
        if opened is None:
            held = sum(o.size for o in self._open.values())
            mapped = sum(o.pieces for o in self._open.values()) + pieces_of(region)
            if (
                len(self._open) >= MAX_OPEN_REGIONS
                or held + region.size > self._max_bytes
                or mapped > MAX_OPEN_PIECES
            ):
                raise ProtocolError(
                    f"{len(self._open)} regions of {held} bytes open: no room for {region.size}"
                )
            opened = open_region(region, self._device, self._max_bytes, self._source)
            self._open[key] = opened
        elif opened.size != region.size:
            raise ProtocolError(f"a region of {opened.size} bytes named as {region.size}")
        opened.used = version
        return opened

    def close(self) -> None:
        """Close every region and the ring (idempotent)."""
        for opened in self._open.values():
            opened.closer()
        self._open.clear()
        self._splits.clear()
        self._ring.close()


def open_region(
    region: Region, device: int, max_bytes: int, source: DescriptorSource | None = None
) -> _Open:
    """Open a peer's region read-only (CPU) or mapped on ``device`` (CUDA), checked.

    A CUDA region's claimed size must not exceed what the driver mapped for its handle; a
    descriptor region's come from the trainer ``source`` names.
    """
    if isinstance(region, ShmHandle):
        from aiosync.planes.shm import ShmSegment

        segment = ShmSegment.attach(region, max_size=max_bytes, writable=False)
        return _Open(region.size, segment.tensor, segment.close, -1)
    if isinstance(region, CudaFdRegion):
        imported = open_fd_region(region, device, source)
        return _Open(region.size, imported.tensor, imported.close, -1, len(region.pieces))
    from aiosync.planes.cuda_runtime import DeviceMemory, runtime

    try:
        memory = DeviceMemory.open(region.handle, region.size, device)
    except AiosyncError as exc:
        runtime().cudaGetLastError()  # not left for torch's next launch check
        raise AiosyncError(f"cannot open a trainer region: {exc.reason}") from None
    found = address_range(memory.tensor.data_ptr())
    if found is None:
        log.warning("the CUDA driver does not say how large a mapped region is; trusting it")
    elif found[1] < region.size:
        memory.close()
        raise ProtocolError(f"a region claims {region.size} bytes; {found[1]} are mapped")
    return _Open(region.size, memory.tensor, memory.close, -1)
