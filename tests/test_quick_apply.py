"""Direct buckets measured quick are applied on the engine's event loop (engine.quick_apply)."""

from __future__ import annotations

import threading

import pytest
import torch

from aiosync import ModuleSink
from aiosync.core.engine_actions import Apply
from aiosync.core.layout import TensorSpec
from aiosync.core.wire import Region, ShmHandle
from aiosync.engine import quick_apply
from aiosync.engine.bulk_apply import Part
from aiosync.engine.quick_apply import INLINE_APPLY, QuickApplies
from tests.models import assert_same
from tests.test_early_begin import Net, direct_pair, state, stepped, tensors


def apply_of(specs: list[TensorSpec], direct: bool = True) -> Apply:
    regions: list[Region] = [ShmHandle("seg", 64)] if direct else []
    return Apply("peer", 1, 1, 2, 64, specs, regions)


def test_a_bucket_is_quick_only_as_the_same_list_measured_quick() -> None:
    quick = QuickApplies()
    specs = [TensorSpec("a", "float32", (4,), 0, 16)]
    action = apply_of(specs)
    assert not quick.quick(action)  # never seen
    quick.note(action, INLINE_APPLY / 2)
    assert quick.quick(action)
    assert quick.quick(apply_of(specs))  # another bucket message, the same list
    assert not quick.quick(apply_of(list(specs)))  # an equal list is another bucket
    quick.note(action, INLINE_APPLY * 2)
    assert not quick.quick(action)  # slow last time: back to the thread


def test_ring_buckets_are_never_quick_and_the_memory_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quick = QuickApplies()
    ring = apply_of([TensorSpec("a", "float32", (4,), 0, 16)], direct=False)
    quick.note(ring, 0.0)
    assert not quick.quick(ring)
    monkeypatch.setattr(quick_apply, "KEPT", 3)
    lists = [[TensorSpec(f"t{i}", "float32", (4,), 0, 16)] for i in range(5)]
    for specs in lists:
        quick.note(apply_of(specs), 0.0)
    assert [quick.quick(apply_of(specs)) for specs in lists] == [False, False, True, True, True]


async def test_steady_direct_versions_are_applied_on_the_loop_bit_exact() -> None:
    torch.manual_seed(0)
    model, engine = Net(), Net()
    loop = threading.get_ident()
    where: list[set[bool]] = []

    class Watched(ModuleSink):
        def apply_parts(self, parts: list[Part]) -> None:
            where[-1].add(threading.get_ident() == loop)
            super().apply_parts(parts)

    async with direct_pair(model, Watched(engine)) as (receiver, sender):
        for version in range(5):
            stepped(model, version)
            where.append(set())
            await sender.send(tensors(model))
            assert receiver.current_version == version
            assert_same(state(engine), state(model))
    assert where[0] == {False}  # first sightings: a worker thread
    assert where[-1] == {True}  # a kept split, measured quick: on the loop
