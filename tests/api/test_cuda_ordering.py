"""The host side of event-chained planes (issue 10, item 1), checked on the CPU.

A shared-memory plane is given the hooks a CUDA plane has (``begin_version``/``consumed`` on
the trainer's side, ``events``/``applied`` on the engine's) and the order of calls is
recorded: the engine's events reach the trainer in its ready, each buffer is packed again
only after every ack of its last use was handed to ``consumed``, the engine records
``applied`` after the sink queued its copies, and the sink's device wait is deferred only
inside such an apply (the bucket's context, handed to the sink, says so).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.core.layout import BucketPlan
from aiosync.planes.base import BucketContext, Part
from aiosync.planes.shm import ShmReceiverPlane, ShmSenderPlane

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])
ENGINE_EVENTS = [b"a" * 64, b"b" * 64]


class RecordingSink(ModuleSink):
    def __init__(self, model: dict[str, torch.Tensor], log: list[tuple[Any, ...]]) -> None:
        super().__init__(model)
        self.log = log

    def apply_with(self, parts: list[Part], context: BucketContext) -> None:
        self.log.append(("apply", context.deferred))
        super().apply_with(parts, context)


@only_asyncio
@pytest.mark.parametrize("with_events", [True, False])
async def test_hooks_run_in_the_order_the_events_need(
    monkeypatch: pytest.MonkeyPatch, with_events: bool
) -> None:
    log: list[tuple[Any, ...]] = []
    pack = ShmSenderPlane.pack

    def begin_version(self: ShmSenderPlane) -> None:
        log.append(("begin_version", threading.current_thread() is threading.main_thread()))

    def consumed(self: ShmSenderPlane, index: int, events: list[bytes]) -> None:
        log.append(("consumed", index, list(events)))

    def recording_pack(self: ShmSenderPlane, index: int, plan: BucketPlan) -> None:
        log.append(("pack", index))
        pack(self, index, plan)

    def applied(self: ShmReceiverPlane, index: int) -> None:
        log.append(("applied", index))

    monkeypatch.setattr(ShmSenderPlane, "begin_version", begin_version, raising=False)
    monkeypatch.setattr(ShmSenderPlane, "consumed", consumed, raising=False)
    monkeypatch.setattr(ShmSenderPlane, "pack", recording_pack)
    monkeypatch.setattr(ShmReceiverPlane, "applied", applied, raising=False)
    events = ENGINE_EVENTS if with_events else []
    monkeypatch.setattr(ShmReceiverPlane, "events", events, raising=False)

    weights = {f"w{i}": torch.full((1024,), float(i)) for i in range(6)}  # 4 KiB each
    model = {name: torch.zeros_like(t) for name, t in weights.items()}
    config = SenderConfig(buffer_bytes=8192, num_buffers=2)  # two tensors a bucket
    async with (
        WeightReceiver(RecordingSink(model, log)) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        assert [link.events for link in sender._links.values()] == [events]
        for version in range(2):
            await sender.send(weights, version=version)
    assert all(torch.equal(model[n], weights[n]) for n in weights)

    assert log.count(("begin_version", True)) == 2  # once a version, on the caller's thread
    applies = [entry for entry in log if entry[0] == "apply"]
    assert applies == [("apply", with_events)] * 6  # deferred only under a plane with events
    recorded = [e for e in log if e[0] == "applied"]
    assert recorded == ([("applied", i) for i in (0, 1, 0)] * 2 if with_events else [])
    # each packing of a buffer after its first comes after the ack of its last use
    last_use: dict[int, bool] = {}
    for entry in log:
        if entry[0] == "pack":
            assert last_use.get(entry[1], True), f"buffer {entry[1]} packed before its ack"
            last_use[entry[1]] = False
        elif entry[0] == "consumed":
            assert entry[2] == events
            last_use[entry[1]] = True
    assert sum(1 for e in log if e[0] == "consumed") == 6
