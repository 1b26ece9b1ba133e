"""Descriptor regions (direct mode without legacy CUDA handles), on the CPU.

:class:`FakeAllocations` stands in for the driver: an address space of "physical
allocations" (mappings with an id), each exported as a plain file holding its id. The
trainer's :class:`~aiosync.planes.fd_regions.FdRegions` cuts tensors' spans into pieces,
names regions, serves their descriptors over its real socket, and refuses what moved; an
engine's checks bound what a region may claim. What needs a GPU (the driver's mapping of
the descriptors) is in ``tests/gpu/test_cuda_direct_vmm.py``.
"""

from __future__ import annotations

import bisect
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.plane_specs import CudaFdRegion, DescriptorSource
from aiosync.core.wire import (
    PROTOCOL,
    Bucket,
    DirectPlaneSpec,
    Hello,
    ShmHandle,
    decode,
    encode,
)
from aiosync.planes.cuda_vmm import POSIX_FD, Mapping
from aiosync.planes.direct import MAX_OPEN_PIECES, DirectReceiverPlane
from aiosync.planes.direct_regions import Spot, expandable_ranges, within
from aiosync.planes.fd_passing import MAX_PIECES, fetch_fds
from aiosync.planes.fd_regions import (
    NO_FD_EXPORT,
    NO_MAPPING,
    TOO_MANY_PIECES,
    CudaAllocations,
    FdRegions,
    check_fd_region,
    pieces_of,
    span_pieces,
)
from aiosync.trainer.direct_plans import OPEN_PIECES, within_bounds

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


class FakeAllocations(CudaAllocations):
    """Mappings by base address; each exported as a file that holds its allocation's id."""

    def __init__(self) -> None:
        super().__init__(0)
        self.mappings: dict[int, Mapping] = {}
        self.directory = Path(tempfile.mkdtemp())
        self.blocks = 0
        self.exports = 0
        self.prepared: list[str] = []
        self.refuse = False
        self._bases: list[int] = []

    def map(self, base: int, size: int, types: int = POSIX_FD) -> Mapping:
        """A new allocation mapped at ``base`` (replacing whatever was there)."""
        self.blocks += 1
        mapping = Mapping(base, size, self.blocks, types)
        self.mappings[base] = mapping
        return mapping

    def query(self) -> object:  # type: ignore[override]
        def at(pointer: int) -> Mapping | None:
            bases = sorted(self.mappings) if len(self.mappings) < 64 else self._sorted()
            i = bisect.bisect_right(bases, pointer) - 1
            mapping = self.mappings[bases[i]] if i >= 0 else None
            if mapping is not None and pointer < mapping.base + mapping.size:
                return mapping
            return None

        return at

    def _sorted(self) -> list[int]:
        if len(self._bases) != len(self.mappings):
            self._bases = sorted(self.mappings)
        return self._bases

    def export(self, pointer: int) -> int:
        if self.refuse:
            raise AiosyncError("cuMemRetainAllocationHandle failed: not mapped by cuMemMap")
        mapping = self.query()(pointer)  # type: ignore[operator]
        assert mapping is not None
        self.exports += 1
        path = self.directory / f"export-{self.exports}"
        path.write_text(str(mapping.block))
        fd = os.open(path, os.O_RDONLY)
        path.unlink()
        return fd

    def prepare(self) -> None:
        self.prepared.append(threading.current_thread().name)


@pytest.fixture
def fake() -> Iterator[tuple[FakeAllocations, FdRegions]]:
    allocations = FakeAllocations()
    regions = FdRegions(0, allocations)
    yield allocations, regions
    regions.close()
    allocations.directory.rmdir()


def blocks_of(source: DescriptorSource, region: CudaFdRegion) -> list[int]:
    """The allocation ids behind the descriptors an engine gets for ``region``."""
    blocks: list[int] = []
    sizes: list[int] = []

    def take(batch: list[tuple[int, int]]) -> None:
        blocks.extend(int(os.pread(fd, 32, 0)) for fd, _ in batch)
        sizes.extend(size for _, size in batch)

    fetch_fds(source, region.ident, len(region.pieces), take)
    assert tuple(sizes) == region.pieces
    return blocks


def test_a_span_is_cut_at_every_allocation_it_crosses() -> None:
    fake = FakeAllocations()
    for i in range(4):
        fake.map((1 << 30) + i * 20 * MiB, 20 * MiB)
    query = fake.query()
    inside = span_pieces((1 << 30) + 5 * MiB, 3 * MiB, query)  # type: ignore[arg-type]
    assert isinstance(inside, tuple)
    assert [p.block for p in inside] == [1]
    across = span_pieces((1 << 30) + 19 * MiB, 42 * MiB, query)  # type: ignore[arg-type]
    assert isinstance(across, tuple)
    assert [p.block for p in across] == [1, 2, 3, 4]  # 19 MiB + 42 MiB ends in the fourth
    exact = span_pieces((1 << 30) + 20 * MiB, 20 * MiB, query)  # type: ignore[arg-type]
    assert isinstance(exact, tuple)
    assert [p.block for p in exact] == [2]
    past = span_pieces((1 << 30) + 70 * MiB, 20 * MiB, query)  # type: ignore[arg-type]
    assert past == NO_MAPPING  # runs into unmapped memory
    fake.directory.rmdir()


def test_memory_that_cannot_be_exported_as_a_descriptor_is_said_so() -> None:
    fake = FakeAllocations()
    fake.map(1 << 30, 2 * MiB, types=0x8)  # a fabric handle only
    assert span_pieces(1 << 30, 16, fake.query()) == NO_FD_EXPORT  # type: ignore[arg-type]
    assert span_pieces(1 << 20, 16, fake.query()) == NO_MAPPING  # type: ignore[arg-type]
    many = FakeAllocations()
    for i in range(MAX_PIECES + 1):
        many.map((1 << 30) + i * 4096, 4096)
    got = span_pieces(1 << 30, (MAX_PIECES + 1) * 4096, many.query())  # type: ignore[arg-type]
    assert got == TOO_MANY_PIECES
    fake.directory.rmdir()
    many.directory.rmdir()


def test_tensors_over_the_same_allocations_share_a_region_and_idents_never_repeat(
    fake: tuple[FakeAllocations, FdRegions],
) -> None:
    allocations, regions = fake
    for i in range(3):
        allocations.map((1 << 30) + i * 2 * MiB, 2 * MiB)
    a = regions.locate((1 << 30) + 512, 1024)
    b = regions.locate((1 << 30) + 4096, 1024)
    c = regions.locate((1 << 30) + MiB, 2 * MiB)  # crosses into the second allocation
    assert not isinstance(a, str)
    assert not isinstance(b, str)
    assert not isinstance(c, str)
    assert a[0] is b[0]
    assert (a[2], b[2], c[2]) == (512, 4096, MiB)
    assert c[0].pieces == (2 * MiB, 2 * MiB)
    assert c[0].size == 4 * MiB
    assert a[0].ident != c[0].ident
    assert allocations.exports == 1  # one trial export: the same allocation starts both
    regions.retain({c[1]})  # a fresh split that names only c's region
    again = regions.locate((1 << 30) + 512, 1024)
    assert not isinstance(again, str)
    assert again[0].ident not in (a[0].ident, c[0].ident)


def test_an_engine_gets_the_descriptors_of_exactly_its_region_s_allocations(
    fake: tuple[FakeAllocations, FdRegions],
) -> None:
    allocations, regions = fake
    for i in range(100):  # more than one message of descriptors
        allocations.map((1 << 30) + i * 2 * MiB, 2 * MiB)
    found = regions.locate(1 << 30, 100 * 2 * MiB)
    assert not isinstance(found, str)
    source = regions.source
    assert source is not None
    assert blocks_of(source, found[0]) == list(range(1, 101))
    assert allocations.prepared == ["aiosync-fd-server"]  # once, on the serving thread


def test_memory_remapped_since_the_split_is_refused_and_seen_by_still(
    fake: tuple[FakeAllocations, FdRegions],
) -> None:
    allocations, regions = fake
    allocations.map(1 << 30, 2 * MiB)
    allocations.map((1 << 30) + 2 * MiB, 2 * MiB)
    found = regions.locate(1 << 30, 3 * MiB)
    assert not isinstance(found, str)
    region, pieces, _ = found
    assert regions.still(pieces)
    allocations.map((1 << 30) + 2 * MiB, 2 * MiB)  # unmapped and another mapped there
    assert not regions.still(pieces)
    source = regions.source
    assert source is not None
    with pytest.raises(AiosyncError, match="remapped"):
        blocks_of(source, region)
    regions.retain(set())
    with pytest.raises(AiosyncError, match=f"no region {region.ident}"):
        blocks_of(source, region)


def test_a_region_whose_export_fails_is_packed_with_the_driver_s_reason(
    fake: tuple[FakeAllocations, FdRegions],
) -> None:
    allocations, regions = fake
    allocations.map(1 << 30, 2 * MiB)
    allocations.refuse = True
    why = regions.locate(1 << 30, 1024)
    assert isinstance(why, str)
    assert "file descriptor export failed" in why
    assert "not mapped by cuMemMap" in why


def test_an_engine_bounds_what_a_region_may_claim() -> None:
    check_fd_region(CudaFdRegion(1, (2 * MiB, 20 * MiB), 22 * MiB))
    for bad in (
        CudaFdRegion(1, (), 0),
        CudaFdRegion(1, (2 * MiB,) * (MAX_PIECES + 1), (MAX_PIECES + 1) * 2 * MiB),
        CudaFdRegion(1, (2 * MiB, 0), 2 * MiB),
        CudaFdRegion(1, (2 * MiB, 2 * MiB), 2 * MiB),
    ):
        with pytest.raises(ProtocolError):
            check_fd_region(bad)


def test_descriptor_regions_travel_in_a_bucket() -> None:
    region = CudaFdRegion(3, (20 * MiB, 2 * MiB), 22 * MiB)
    bucket = Bucket(1, 1, 2, 22 * MiB, regions=[region, ShmHandle("n", 4)])
    again = decode(encode(bucket))
    assert isinstance(again, Bucket)
    assert again.regions == [region, ShmHandle("n", 4)]
    assert isinstance(again.regions[0], CudaFdRegion)
    assert again.regions[0].pieces == (20 * MiB, 2 * MiB)
    assert hash(again.regions[0]) == hash(region)  # an engine keeps it open by itself


def test_a_hello_carries_the_descriptor_source() -> None:
    from aiosync.core.wire import CudaPlaneSpec

    source = DescriptorSource("/tmp/x/regions.sock", 42, 7, b"s" * 32)
    spec = DirectPlaneSpec(CudaPlaneSpec(0, 1024, [b"h" * 64]), 1 << 30, b"e" * 64, source)
    hello = Hello(PROTOCOL, PROTOCOL, "s", "t", spec)
    again = decode(encode(hello))
    assert isinstance(again, Hello)
    assert isinstance(again.plane, DirectPlaneSpec)
    assert again.plane.descriptors == source
    plain = Hello(PROTOCOL, PROTOCOL, "s", "t", DirectPlaneSpec(spec.ring, 1 << 30))
    got = decode(encode(plain))
    assert isinstance(got, Hello)
    assert isinstance(got.plane, DirectPlaneSpec)
    assert got.plane.descriptors is None


def test_one_version_keeps_within_half_an_engine_s_bound_on_mapped_pieces() -> None:
    tensor = torch.zeros(4)
    per = 1000
    located = [
        (f"t{i}", tensor, Spot(CudaFdRegion(i, (2 * MiB,) * per, per * 2 * MiB), i, 0))
        for i in range(OPEN_PIECES // per + 2)
    ]
    packed: list[tuple[str, object]] = []
    kept = within_bounds(located, packed)
    assert len(kept) == OPEN_PIECES // per
    assert sum(pieces_of(spot.region) for _, _, spot in kept) <= OPEN_PIECES
    assert [name for name, _ in packed] == [f"t{i}" for i in range(len(kept), len(located))]
    assert OPEN_PIECES * 2 == MAX_OPEN_PIECES


def test_pages_of_the_allocator_s_expandable_segments_are_found() -> None:
    snapshot = [
        {"device": 0, "address": 1000, "total_size": 500, "is_expandable": True},
        {"device": 0, "address": 4000, "total_size": 100, "is_expandable": False},
        {"device": 1, "address": 2000, "total_size": 500, "is_expandable": True},
        {"device": 0, "address": 3000, "total_size": 200, "is_expandable": True},
    ]
    ranges = expandable_ranges(snapshot, 0)
    assert ranges == [(1000, 1500), (3000, 3200)]
    assert within(ranges, 1000, 1500)
    assert within(ranges, 3100, 3200)
    assert not within(ranges, 1400, 1600)  # past a mapped range's end
    assert not within(ranges, 2000, 2100)  # another device's
    assert not within(ranges, 900, 1000)


def test_an_engine_refuses_descriptor_regions_past_its_bounds_or_without_a_socket() -> None:
    """The receiver's checks, before any descriptor is asked for (its CUDA ring faked)."""
    from aiosync.core.layout import TensorSpec
    from aiosync.planes.direct import _Open
    from aiosync.planes.shm import ShmSenderPlane

    ring = ShmSenderPlane(1, 1 << 20)
    plane = DirectReceiverPlane(DirectPlaneSpec(ring.spec, 1 << 40), torch.device("cpu"), None)
    try:
        plane._cuda = True  # as a CUDA ring's plane, whose trainer named no socket
        region = CudaFdRegion(1, (2 * MiB, 2 * MiB), 4 * MiB)
        spec = TensorSpec("w", "float32", (4,), 0, 16)
        with pytest.raises(ProtocolError, match="named no socket"):
            plane.parts(1, 4 * MiB, [spec], [region], 0)
        plane._source = DescriptorSource("/nonexistent/regions.sock", os.getpid(), 0, b"t")
        held = _Open(MiB, torch.zeros(1), lambda: None, 0, MAX_OPEN_PIECES - 1)
        plane._open["held"] = held  # regions mapping all but one piece the engine allows
        with pytest.raises(ProtocolError, match="no room"):  # no socket call made
            plane.parts(1, 4 * MiB, [spec], [region], 0)
        del plane._open["held"]
        with pytest.raises(AiosyncError, match="cannot open a trainer region: cannot reach"):
            plane.parts(1, 4 * MiB, [spec], [region], 0)
    finally:
        plane.close()
        ring.close()
