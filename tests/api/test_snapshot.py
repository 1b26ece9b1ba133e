"""When the trainer may touch its tensors again: once every byte is packed, not at commit."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from aiosync import (
    MismatchError,
    ModuleSink,
    RejectedError,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.planes.shm import ShmSenderPlane


class SlowSink(ModuleSink):
    """Applies each bucket a little slowly, so the engine is still busy after packing."""

    applied_after_packed = 0
    packed_at: float | None = None

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        time.sleep(0.02)
        super().apply_bucket(bucket, specs)
        if self.packed_at is not None:
            self.applied_after_packed += 1


async def test_the_engine_commits_the_snapshot_although_the_trainer_steps_once_packed() -> None:
    weights = {f"w{i}": torch.full((4096,), float(i)) for i in range(32)}
    snapshot = {name: tensor.clone() for name, tensor in weights.items()}
    model = {name: torch.zeros(4096) for name in weights}
    sink = SlowSink(model)
    config = SenderConfig(buffer_bytes=32 << 10, num_buffers=4)
    async with (
        WeightReceiver(sink) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        packed = anyio.Event()
        reports = []

        async def send() -> None:
            reports.append(await sender.send(weights, version=0, packed=packed))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await packed.wait()
            sink.packed_at = time.monotonic()
            assert not reports  # packed comes before the engines commit
            with torch.no_grad():
                for tensor in weights.values():
                    tensor.add_(100.0)  # the optimizer steps while the engine still applies
        assert reports[0].version == 0
    assert sink.applied_after_packed > 0  # the step really overlapped the engine's work
    assert all(torch.equal(model[name], snapshot[name]) for name in weights)


async def test_packed_is_set_when_a_send_fails_too() -> None:
    async with (
        WeightReceiver(ModuleSink({"w": torch.zeros(3)})) as receiver,
        WeightSender(receiver.endpoint) as sender,
    ):
        packed = anyio.Event()
        with pytest.raises(RejectedError):
            await sender.send({"unknown": torch.ones(3)}, version=0, packed=packed)
        assert packed.is_set()


async def test_check_snapshot_fails_a_version_changed_before_it_was_packed() -> None:
    """The debugging aid: a step before `packed` (here, inside the first bucket's packing)
    fails the version before any engine commits it."""
    weights = {f"w{i}": torch.full((4096,), float(i)) for i in range(32)}
    model = {name: torch.zeros(4096) for name in weights}
    plane_pack = ShmSenderPlane.pack
    stepped = []

    def pack_and_step(self: ShmSenderPlane, index: int, plan: BucketPlan) -> None:
        plane_pack(self, index, plan)
        if not stepped:  # the trainer steps while the version is still being packed
            stepped.append(True)
            for tensor in weights.values():
                tensor.add_(1.0)

    config = SenderConfig(buffer_bytes=32 << 10, num_buffers=2, check_snapshot=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShmSenderPlane, "pack", pack_and_step)
        async with (
            WeightReceiver(ModuleSink(model, staged=True)) as receiver,
            WeightSender(receiver.endpoint, config=config) as sender,
        ):
            with pytest.raises(MismatchError, match="changed while the version was being packed"):
                await sender.send(weights, version=0)
            assert receiver.current_version is None
            assert all(torch.equal(t, torch.zeros(4096)) for t in model.values())
            stepped.append(True)  # no more steps
            await sender.send(weights, version=1)  # unchanged while packed: commits
            assert receiver.current_version == 1
