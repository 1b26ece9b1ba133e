"""Direct buckets measured quick are applied on the engine's event loop (engine.quick_apply)."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender, share_tensors
from aiosync.core.engine_actions import Apply
from aiosync.core.layout import TensorSpec
from aiosync.core.wire import Region, ShmHandle
from aiosync.engine import quick_apply
from aiosync.engine.quick_apply import INLINE_APPLY, QuickApplies
from tests.test_early_begin import Net, state, stepped, tensors


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
        def apply_parts(self, parts):  # type: ignore[no-untyped-def]
            where[-1].add(threading.get_ident() == loop)
            super().apply_parts(parts)

    config = SenderConfig(direct=True, buffer_bytes=64 * 1024, timeout=10)
    with share_tensors(model):
        async with (
            WeightReceiver(Watched(engine)) as receiver,
            WeightSender(receiver.endpoint, config=config) as sender,
        ):
            for version in range(5):
                stepped(model, version)
                where.append(set())
                await sender.send(tensors(model))
                with anyio.fail_after(10):
                    while receiver.current_version != version:
                        await anyio.sleep(0.01)
                for name, value in state(model).items():
                    assert torch.equal(state(engine)[name], value), name
    assert where[0] == {False}  # first sightings: a worker thread
    assert where[-1] == {True}  # a kept split, measured quick: on the loop
