"""Read leases: a request pins the weights it reads; versions go live between requests."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiosync import (
    ModuleSink,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    UsageError,
    WeightReceiver,
    WeightSender,
)
from aiosync.core.errors import SyncTimeoutError
from aiosync.engine.leases import LeaseGate

NAMES = [f"layer.{i}" for i in range(8)]


def weights(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full((4096,), value) for name in NAMES}


async def test_a_swap_waits_for_readers_and_new_readers_wait_for_the_swap() -> None:
    gate = LeaseGate()
    order: list[str] = []
    first_in = anyio.Event()
    release = anyio.Event()

    async def first_reader() -> None:
        async with gate.lease(10):
            first_in.set()
            await release.wait()
            order.append("reader 1 done")

    async def swap() -> None:
        async with gate.exclusive(10):
            order.append("swapped")

    async def late_reader() -> None:
        async with gate.lease(10):
            order.append("reader 2 in")

    async with anyio.create_task_group() as tg:
        tg.start_soon(first_reader)
        await first_in.wait()
        tg.start_soon(swap)
        await anyio.wait_all_tasks_blocked()
        assert gate.swap_pending
        tg.start_soon(late_reader)
        await anyio.wait_all_tasks_blocked()
        assert order == []  # the swap waits for reader 1; reader 2 waits for the swap
        release.set()
    assert order == ["reader 1 done", "swapped", "reader 2 in"]


async def test_a_swap_gives_up_after_its_bound() -> None:
    gate = LeaseGate()
    async with gate.lease(10):
        with pytest.raises(SyncTimeoutError, match="read leases still held"):
            async with gate.exclusive(0.05):
                pass  # never reached
    assert not gate.swap_pending
    async with gate.exclusive(1):
        pass


async def test_every_request_reads_exactly_the_version_it_was_given() -> None:
    model = weights(0.0)
    config = ReceiverConfig(swap_timeout=30)
    seen: list[int] = []

    async def request() -> None:
        async with receiver.serving() as version:
            if version is None:
                return
            first = [float(model[name][0]) for name in NAMES]
            await anyio.sleep(0.003)  # a request takes a while; versions arrive meanwhile
            last = [float(model[name][-1]) for name in NAMES]
            assert first == last == [float(version)] * len(NAMES), (version, first, last)
            seen.append(version)

    async def requests(stop: anyio.Event) -> None:
        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                for _ in range(4):
                    tg.start_soon(request)
                await anyio.sleep(0.002)

    async with (
        WeightReceiver(ModuleSink(model, staged=True), config=config) as receiver,
        WeightSender(receiver.endpoint, config=SenderConfig(buffer_bytes=16 << 10)) as sender,
    ):
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(requests, stop)
            for version in range(1, 11):
                await sender.send(weights(float(version)), version=version)
            await anyio.sleep(0.02)
            stop.set()
    assert receiver.current_version == 10
    assert len(set(seen)) > 1  # requests ran across versions
    assert seen == sorted(seen)


async def test_leases_need_a_staged_sink() -> None:
    async with WeightReceiver(ModuleSink(weights(0.0))) as receiver:
        with pytest.raises(UsageError, match="staged"):
            async with receiver.serving():
                pass


async def test_a_lease_held_past_the_swap_bound_refuses_the_version_and_nothing_changes() -> None:
    model = weights(1.0)
    config = ReceiverConfig(swap_timeout=0.2)
    async with (
        WeightReceiver(ModuleSink(model, staged=True), config=config) as receiver,
        WeightSender(receiver.endpoint) as sender,
    ):
        await sender.send(weights(1.0), version=1)
        async with receiver.serving() as version:
            assert version == 1
            with pytest.raises(RejectedError, match="read leases still held"):
                await sender.send(weights(2.0), version=2)
            assert all(float(t[0]) == 1.0 for t in model.values())
        assert receiver.current_version == 1
        assert receiver.servable  # nothing was touched
        await sender.send(weights(3.0), version=3)
        assert receiver.current_version == 3
        assert all(float(t[0]) == 3.0 for t in model.values())
