"""The direct-mode trainer's per-version region checks, on the CPU with a fake driver.

A :class:`FakeFinder` stands in for the CUDA driver and torch's caching allocator: it
places "allocations" over CPU tensors' storages, hands out buffer ids, and keeps the
allocator's segment counters. The reader keeps its split across versions and looks a
region up only when the allocator cannot vouch for it (see
:mod:`aiosync.planes.direct_regions`): these tests count the lookups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from aiosync.core.layout import MAX_BUCKET_ITEMS, BucketPlan
from aiosync.core.planning import VersionSource
from aiosync.core.wire import CudaRegion, Region
from aiosync.pipeline.ahead import read_here
from aiosync.planes.direct import DirectPlan
from aiosync.planes.direct_regions import (
    NOT_PLAIN,
    RegionFinder,
    Spot,
    allocator_marker,
    segment_bases,
)
from aiosync.trainer.direct import DirectReader

pytestmark = pytest.mark.timeout(60)


class FakeFinder(RegionFinder):
    """A device's allocations by base address, as the driver and the allocator see them."""

    def __init__(self) -> None:
        super().__init__(torch.device("cuda", 0))  # never touches a device: all replaced
        self.allocations: dict[int, tuple[int, int]] = {}  # base -> (size, buffer id)
        self.segments: set[int] = set()  # bases the caching allocator owns
        self.counts = {"allocated": 0, "freed": 0, "current": 0}
        self.lookups = 0
        self.snapshots = 0
        self.stats_fail = False
        self.during_locate: Any = None  # called inside each locate (a racing free)
        self._ids = 0

    def allocate(self, tensor: torch.Tensor, *, owned: bool = True) -> None:
        """An allocation over ``tensor``'s whole storage (a caching segment if ``owned``)."""
        storage = tensor.untyped_storage()
        self._ids += 1
        self.allocations[storage.data_ptr()] = (storage.nbytes(), self._ids)
        if owned:
            self.segments.add(storage.data_ptr())
            self.counts["allocated"] += 1
            self.counts["current"] += 1

    def release(self, tensor: torch.Tensor) -> None:
        """Free the allocation over ``tensor``'s storage (counted if the allocator's)."""
        base = tensor.untyped_storage().data_ptr()
        del self.allocations[base]
        if base in self.segments:
            self.segments.discard(base)
            self.counts["freed"] += 1
            self.counts["current"] -= 1

    def _find(self, pointer: int) -> tuple[int, int, int] | None:
        for base, (size, buffer_id) in self.allocations.items():
            if base <= pointer < base + size:
                return base, size, buffer_id
        return None

    def locate(self, tensor: torch.Tensor) -> Spot | str:
        if self.during_locate is not None:
            self.during_locate()
        if not tensor.is_contiguous():  # as RegionFinder.locate
            return NOT_PLAIN
        found = self._find(tensor.data_ptr())
        if found is None:
            return "not in any allocation"
        base, size, buffer_id = found
        self._bases[buffer_id] = base
        handle = buffer_id.to_bytes(8, "little") * 8
        return Spot(CudaRegion(handle, size), buffer_id, tensor.data_ptr() - base)

    def still(self, tensor: torch.Tensor, spot: Spot) -> bool:
        self.lookups += 1
        found = self._find(tensor.data_ptr())
        return found is not None and found[2] == spot.key

    def _stats(self) -> Mapping[str, Any]:
        if self.stats_fail:
            raise RuntimeError("not supported by this allocator")
        return {
            "segment": {"all": dict(self.counts)},
            "num_device_alloc": self.counts["allocated"],
            "num_device_free": self.counts["freed"],
        }

    def _segment_bases(self) -> frozenset[int]:
        self.snapshots += 1
        return frozenset(self.segments)


@dataclass
class FakePlane:
    finder: FakeFinder
    count: int = 2
    packs: int = 0

    def pack(self, index: int, plan: object) -> None:
        self.packs += not isinstance(plan, DirectPlan)  # a direct plan has nothing to copy


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(64, 32))
        self.b = torch.nn.Parameter(torch.randn(128))
        self.c = torch.nn.Parameter(torch.randn(16, 16).to(torch.bfloat16))


def setup(*, owned: bool = True) -> tuple[Net, FakeFinder, DirectReader]:
    net = Net()
    finder = FakeFinder()
    for p in net.parameters():
        finder.allocate(p, owned=owned)
    reader = DirectReader(FakePlane(finder), True)  # type: ignore[arg-type]
    return net, finder, reader


def read(reader: DirectReader, net: Net) -> list[Region]:
    """Read a version; the regions its direct buckets name, in order."""
    source = reader.read(dict(net.named_parameters()), None, 1 << 20, MAX_BUCKET_ITEMS)
    return [r for plan in source.plans if isinstance(plan, DirectPlan) for r in plan.regions]


def test_steady_versions_look_no_region_up() -> None:
    net, finder, reader = setup()
    first = read(reader, net)
    assert reader.fresh
    assert reader.checked == 3
    assert len(first) == 3
    assert finder.snapshots == 1  # which regions the allocator owns: once, at the split
    for _ in range(5):
        assert read(reader, net) == first
        assert not reader.fresh
        assert reader.checked == 0
    assert finder.lookups == 0
    assert finder.snapshots == 1


def test_a_released_segment_makes_every_region_looked_up_once() -> None:
    net, finder, reader = setup()
    first = read(reader, net)
    other = torch.empty(1000)
    finder.allocate(other)
    finder.release(other)  # empty_cache released some segment: which, nobody says
    assert read(reader, net) == first
    assert not reader.fresh
    assert reader.checked == 3
    assert finder.lookups == 3
    assert read(reader, net) == first  # the new counters vouch again
    assert reader.checked == 0
    assert finder.lookups == 3


def test_a_new_allocation_at_the_same_address_is_found_and_exported_anew() -> None:
    """The same Parameter object, data_ptr, size and storage, but its segment released
    (``empty_cache``) and a new one made at the same address: a new region."""
    net, finder, reader = setup()
    first = read(reader, net)
    finder.release(net.b)
    finder.allocate(net.b)  # the driver handed out the same address again
    again = read(reader, net)
    assert reader.fresh
    assert again[0] == first[0]
    assert again[2] == first[2]
    assert again[1] != first[1]  # another handle: the new allocation's
    assert read(reader, net) == again
    assert reader.checked == 0


def test_memory_the_allocator_does_not_own_is_looked_up_every_version() -> None:
    net, finder, reader = setup()
    foreign = torch.nn.Parameter(torch.randn(40))
    finder.allocate(foreign, owned=False)  # cudaMalloc'd by another library
    source = {**dict(net.named_parameters()), "foreign": foreign}

    def version() -> list[Region]:
        plans = reader.read(source, None, 1 << 20, MAX_BUCKET_ITEMS).plans
        return [r for p in plans if isinstance(p, DirectPlan) for r in p.regions]

    first = version()
    for _ in range(3):
        assert version() == first
        assert reader.checked == 1  # the foreign region alone
    # that library frees it and allocates again at the same address, uncounted
    finder.release(foreign)
    finder.allocate(foreign, owned=False)
    assert version() != first
    assert reader.fresh


def test_a_tensor_moved_to_other_memory_is_split_again() -> None:
    net, finder, reader = setup()
    first = read(reader, net)
    net.a.data = net.a.data.clone()  # .data = : same object, new address
    finder.allocate(net.a)
    again = read(reader, net)
    assert reader.fresh
    assert again[0] != first[0]


@pytest.mark.parametrize("why", ["reset", "unreadable"])
def test_without_a_trustworthy_signal_every_region_is_looked_up(why: str) -> None:
    net, finder, reader = setup()
    if why == "reset":  # reset_accumulated_memory_stats with segments alive
        finder.counts.update(allocated=0, freed=0)
    else:
        finder.stats_fail = True
    read(reader, net)
    assert finder.snapshots == 0  # no signal: nothing to vouch for, no snapshot taken
    for _ in range(3):
        read(reader, net)
        assert reader.checked == 3
    assert finder.lookups == 9


def test_a_release_while_the_split_is_made_is_seen_next_version() -> None:
    """The marker is read before the lookups it vouches for."""
    net, finder, reader = setup()
    spare = torch.empty(10)
    finder.allocate(spare)

    def race() -> None:
        finder.during_locate = None  # once
        finder.release(spare)

    finder.during_locate = race
    read(reader, net)
    assert finder.counts["freed"] == 1
    read(reader, net)
    assert reader.checked == 3  # the release raced the split: everything looked up
    read(reader, net)
    assert reader.checked == 0


def test_the_allocator_marker_and_the_snapshot_parser() -> None:
    stats = {"segment": {"all": {"allocated": 5, "freed": 2, "current": 3}}}
    assert allocator_marker(stats) == (5, 2, 0, 0)
    both = {**stats, "num_device_alloc": 6, "num_device_free": 2}
    assert allocator_marker(both) == (5, 2, 6, 2)
    reset = {"segment": {"all": {"allocated": 0, "freed": 0, "current": 3}}}
    assert allocator_marker(reset) is None
    assert allocator_marker({}) is None
    assert allocator_marker({"segment": {"all": {"allocated": "x"}}}) is None
    snapshot = [
        {"device": 0, "address": 4096, "total_size": 2 << 20},
        {"device": 1, "address": 8192, "total_size": 2 << 20},
        {"device": 0, "address": 1 << 40, "total_size": 20 << 20, "is_expandable": True},
    ]
    assert segment_bases(snapshot, 0) == frozenset({4096})
    assert segment_bases(snapshot, 1) == frozenset({8192})


def test_a_cpu_finder_vouches_for_nothing() -> None:
    finder = RegionFinder(torch.device("cpu"))
    assert finder.marker() is None
    assert finder.allocator_owned({"memfd-name"}) == set()


def test_a_tensor_made_a_strided_view_in_place_is_split_afresh_and_packed() -> None:
    """``p.data = p.data.t()``: the same object, address, dtype and (square) shape, and
    no segment released, but no longer contiguous: its raw bytes must not go direct."""
    net, _, reader = setup()
    assert len(read(reader, net)) == 3
    net.c.data = net.c.data.t()
    again = read(reader, net)
    assert reader.fresh
    assert len(again) == 2
    assert "not contiguous (1)" in reader.note


def test_direct_buckets_are_planned_again_when_the_engines_bound_on_tensors_drops() -> None:
    """An engine with a lower ``max_bucket_tensors`` joined: a kept split's buckets must
    not keep more tensors than it takes."""
    net, _, reader = setup()
    source = reader.read(dict(net.named_parameters()), None, 1 << 20, MAX_BUCKET_ITEMS)
    assert [len(plan.specs) for plan in source.plans] == [3]
    source = reader.read(dict(net.named_parameters()), None, 1 << 20, 2)
    assert not reader.fresh
    assert max(len(plan.specs) for plan in source.plans) <= 2


def test_regions_past_half_the_engines_bounds_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine keeps the last version's regions open while it opens the next one's: a
    version reads at most half its bounds directly, and packs the rest (saying why)."""
    import aiosync.trainer.direct_plans as direct_plans

    net, _, reader = setup()
    monkeypatch.setattr(direct_plans, "OPEN_REGIONS", 2)
    assert len(read(reader, net)) == 2
    assert "past the engines' bound on open regions (1)" in reader.note
    by_bytes = setup()
    monkeypatch.setattr(direct_plans, "OPEN_REGIONS", 8)
    monkeypatch.setattr(direct_plans, "OPEN_BYTES", by_bytes[0].a.nbytes)
    assert len(read(by_bytes[2], by_bytes[0])) == 1
    assert "past the engines' bound on open regions (2)" in by_bytes[2].note


def read_kept(reader: DirectReader, net: Net) -> VersionSource | None:
    return reader.read_kept(dict(net.named_parameters()), 1 << 20, MAX_BUCKET_ITEMS)


def test_a_kept_split_is_read_on_the_loop_as_read_reads_it() -> None:
    net, finder, reader = setup()
    assert read_kept(reader, net) is None  # nothing kept yet: the thread's read splits
    reader.read(dict(net.named_parameters()), None, 1 << 20, MAX_BUCKET_ITEMS)
    again = read_kept(reader, net)
    assert again is not None
    assert not reader.fresh
    assert finder.lookups == 0
    fresh = DirectReader(FakePlane(finder), True)  # type: ignore[arg-type]
    expected = fresh.read(dict(net.named_parameters()), None, 1 << 20, MAX_BUCKET_ITEMS)
    assert again.manifest == expected.manifest
    got = [(p.regions, p.specs) for p in again.plans]  # type: ignore[attr-defined]
    assert got == [(p.regions, p.specs) for p in expected.plans]  # type: ignore[attr-defined]
    third = read_kept(reader, net)
    assert third is not None
    assert third.manifest is again.manifest  # one list: its encoded bytes are kept


def test_the_loop_read_leaves_a_split_with_nothing_direct_to_the_thread() -> None:
    net, _, reader = setup()
    reader.chosen = frozenset()  # no tensor asked to go direct: every bucket is packed
    source = reader.read(dict(net.named_parameters()), None, 1 << 20, MAX_BUCKET_ITEMS)
    assert not any(isinstance(plan, DirectPlan) for plan in source.plans)
    assert read_kept(reader, net) is None


def test_the_loop_read_declines_what_is_not_bounded_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiosync.core.where_to_run as where_to_run

    net, finder, reader = setup(owned=False)  # every region looked up each version
    read(reader, net)
    assert read_kept(reader, net) is not None
    monkeypatch.setattr(where_to_run, "LOOP_LOOKUPS", 2)
    assert read_kept(reader, net) is None  # three regions to look up
    monkeypatch.setattr(where_to_run, "LOOP_LOOKUPS", 64)
    monkeypatch.setattr(where_to_run, "LOOP_ENTRIES", 2)
    monkeypatch.setattr(reader, "_sort", None)  # declined before the version is walked
    assert read_kept(reader, net) is None  # three tensors (known from the last read)
    monkeypatch.undo()
    monkeypatch.setattr(where_to_run, "LOOP_ENTRIES", 1024)
    net.a.data = net.a.data.clone()  # moved: the split no longer holds
    finder.allocate(net.a)
    assert read_kept(reader, net) is None
    read(reader, net)
    assert reader.fresh  # the thread's read then splits afresh


def test_read_here_takes_a_direct_bucket_1_and_refuses_a_bucket_to_pack() -> None:
    net, finder, reader = setup()
    plane = FakePlane(finder)
    reader.plane = plane  # type: ignore[assignment]
    read(reader, net)
    got = read_here(lambda: read_kept(reader, net), plane, 0)  # type: ignore[arg-type]
    assert got is not None
    source, first = got
    assert isinstance(first.plan, DirectPlan)
    assert list(source.plans) == []  # the only bucket was taken
    assert plane.packs == 0
    assert read_here(lambda: None, plane, 0) is None  # type: ignore[arg-type]
    packed = VersionSource(None, None, iter([BucketPlan(specs=[], used=64)]))
    with pytest.raises(RuntimeError, match="bucket 1 is to pack"):
        read_here(lambda: packed, plane, 0)  # type: ignore[arg-type]
    assert plane.packs == 0  # nothing packed on the loop
