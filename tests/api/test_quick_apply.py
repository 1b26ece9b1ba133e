"""Buckets measured quick are applied on the engine's event loop (engine.quick_apply)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from aiosync import ModuleSink, RejectedError, SenderConfig, WeightReceiver, WeightSender
from aiosync.core.engine_actions import Apply
from aiosync.core.layout import TensorSpec
from aiosync.core.where_to_run import LOOP_SECONDS
from aiosync.core.wire import Region, ShmHandle
from aiosync.engine import quick_apply
from aiosync.engine.bulk_apply import Part
from aiosync.engine.quick_apply import QuickApplies
from tests.api.test_early_begin import Net, direct_pair, state, stepped, tensors
from tests.helpers.models import assert_same


def apply_of(specs: list[TensorSpec], direct: bool = True) -> Apply:
    regions: list[Region] = [ShmHandle("seg", 64)] if direct else []
    return Apply("peer", 1, 1, 2, 64, specs, regions)


def test_a_bucket_is_quick_only_as_the_same_list_measured_quick() -> None:
    quick = QuickApplies()
    specs = [TensorSpec("a", "float32", (4,), 0, 16)]
    action = apply_of(specs)
    assert not quick.quick(action)  # never seen
    quick.note(action, LOOP_SECONDS / 2)
    assert quick.quick(action)
    assert quick.quick(apply_of(specs))  # another bucket message, the same list
    assert not quick.quick(apply_of(list(specs)))  # an equal list is another bucket
    quick.note(action, LOOP_SECONDS * 2)
    assert not quick.quick(action)  # slow last time: back to the thread


def test_ring_buckets_are_quick_as_measured_held_ones_never_and_the_memory_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quick = QuickApplies()
    ring = apply_of([TensorSpec("a", "float32", (4,), 0, 16)], direct=False)
    quick.note(ring, 0.0)
    assert quick.quick(ring)
    for change in ({"held": True}, {"digest": b"d" * 32}):  # the same, replayed spec list
        resumed = dataclasses.replace(ring, **change)  # type: ignore[arg-type]
        assert not quick.quick(resumed)  # a resume's store reads or writes: the worker's way
        quick.note(resumed, 0.0)
        assert not quick.quick(resumed)
    monkeypatch.setattr(quick_apply, "KEPT", 3)
    lists = [[TensorSpec(f"t{i}", "float32", (4,), 0, 16)] for i in range(5)]
    for specs in lists:
        quick.note(apply_of(specs), 0.0)
    assert [quick.quick(apply_of(specs)) for specs in lists] == [False, False, True, True, True]


def watched(sink: ModuleSink, where: list[set[bool]], fail: list[int]) -> ModuleSink:
    """``sink`` noting, per version, whether each direct bucket ran on this (the loop's)
    thread; it raises while ``fail`` holds a count above 0 (on the instance: the class
    still says it applies quickly)."""
    loop, own = threading.get_ident(), sink.apply_parts

    def apply_parts(parts: list[Part]) -> None:
        where[-1].add(threading.get_ident() == loop)
        if fail and fail[0] > 0:
            fail[0] -= 1
            raise RuntimeError("device lost")
        own(parts)

    sink.apply_parts = apply_parts  # type: ignore[method-assign]
    return sink


async def stream_versions(
    sink: ModuleSink, model: Net, engine: Net, versions: int, where: list[set[bool]]
) -> list[int]:
    """Stream ``versions`` in direct mode; the versions that failed."""
    failed = []
    async with direct_pair(model, sink) as (receiver, sender):
        for version in range(versions):
            stepped(model, version)
            where.append(set())
            try:
                await sender.send(tensors(model), version=version)
            except RejectedError:
                failed.append(version)
                continue
            assert receiver.current_version == version
            assert_same(state(engine), state(model))
    return failed


async def test_steady_direct_versions_are_applied_on_the_loop_bit_exact() -> None:
    torch.manual_seed(0)
    model, engine = Net(), Net()
    where: list[set[bool]] = []
    sink = watched(ModuleSink(engine), where, [])
    assert await stream_versions(sink, model, engine, 5, where) == []
    assert where[0] == {False}  # first sightings: a worker thread
    assert where[-1] == {True}  # a kept split, measured quick: on the loop


async def test_a_quick_apply_that_fails_goes_back_to_the_worker_thread() -> None:
    torch.manual_seed(0)
    model, engine = Net(), Net()
    where: list[set[bool]] = []
    fail = [0]
    sink = watched(ModuleSink(engine), where, fail)
    async with direct_pair(model, sink) as (receiver, sender):
        for version in range(6):
            stepped(model, version)
            where.append(set())
            if version == 3:  # this version's bucket fails, on the loop
                fail[0] = 1
                with pytest.raises(RejectedError, match="device lost"):
                    await sender.send(tensors(model), version=version)
                continue
            await sender.send(tensors(model), version=version)
            assert_same(state(engine), state(model))
        assert receiver.current_version == 5
    assert where[3] == {True}  # it failed on the loop
    assert where[4] == {False}  # forgotten: the worker thread again, and it went through
    assert where[5] == {True}  # measured quick there: back on the loop


@pytest.mark.parametrize("kind", ["subclass", "staged", "renamed"])
async def test_user_code_staging_and_renames_never_run_on_the_loop(kind: str) -> None:
    torch.manual_seed(0)
    model, engine = Net(), Net()
    where: list[set[bool]] = []
    loop = threading.get_ident()

    class Own(ModuleSink):
        def apply_parts(self, parts: list[Part]) -> None:
            where[-1].add(threading.get_ident() == loop)
            super().apply_parts(parts)

    if kind == "subclass":
        sink: ModuleSink = Own(engine)
    else:
        options = {"staged": True} if kind == "staged" else {"rename": lambda name: name}
        sink = watched(ModuleSink(engine, **options), where, [])  # type: ignore[arg-type]
    assert not sink.applies_quickly()
    assert await stream_versions(sink, model, engine, 5, where) == []
    assert set().union(*where) == {False}


def test_only_planes_whose_views_never_wait_take_part() -> None:
    from aiosync.planes.base import ReceiverPlane
    from aiosync.planes.collective_receiver import CollectiveReceiverPlane
    from aiosync.planes.cuda import CudaReceiverPlane
    from aiosync.planes.direct import DirectReceiverPlane
    from aiosync.planes.gathered import GatheredReceiverPlane
    from aiosync.planes.shm import ShmReceiverPlane

    for plane in (ShmReceiverPlane, CudaReceiverPlane, DirectReceiverPlane):
        assert quick_apply.views_at_once(plane)
    for plane in (CollectiveReceiverPlane, GatheredReceiverPlane, ReceiverPlane):
        assert not quick_apply.views_at_once(plane)  # a broadcast may block its deadline


@pytest.mark.parametrize("opted_in", [True, False])
async def test_steady_ring_buckets_run_on_the_loop_only_where_the_plane_opts_in(
    opted_in: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosync.planes.shm import ShmReceiverPlane

    if not opted_in:  # as a plane whose view may block (a collective's) would say
        monkeypatch.setattr(ShmReceiverPlane, "views_at_once", False)
    torch.manual_seed(0)
    model, engine = Net(), Net()
    where: list[set[bool]] = []
    loop = threading.get_ident()
    sink = ModuleSink(engine)
    own = sink.apply_bucket

    def apply_bucket(bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        where[-1].add(threading.get_ident() == loop)
        own(bucket, specs)

    sink.apply_bucket = apply_bucket  # type: ignore[method-assign]
    config = SenderConfig(buffer_bytes=4096, num_buffers=2, timeout=10)  # ring buckets only
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        for version in range(5):
            stepped(model, version)
            where.append(set())
            await sender.send(tensors(model), version=version)
            assert_same(state(engine), state(model))
        assert receiver.failures == []
    assert where[0] == {False}  # first sightings: a worker thread
    assert where[-1] == ({True} if opted_in else {False})
