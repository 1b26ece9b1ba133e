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


# --------------------------------------------------------------------------------------
# when the sender's commit is acknowledged: ReceiverConfig(ack_at="live" | "staged")
# --------------------------------------------------------------------------------------


async def swap_waits(receiver: WeightReceiver) -> None:
    """Return once a swap waits for the read leases (the version is complete and staged)."""
    gate = receiver._leases
    while not gate.swap_pending:
        await gate.changed()


def reads(model: dict[str, torch.Tensor]) -> set[float]:
    return {float(v) for t in model.values() for v in (t[0], t[-1])}


@pytest.mark.parametrize("swap", ["copy", "pointer"])
@pytest.mark.parametrize("ack_at", ["live", "staged"])
async def test_the_commit_ack_waits_for_the_swap_unless_acked_at_staging(
    ack_at: str, swap: str
) -> None:
    model = weights(1.0)
    config = ReceiverConfig(swap_timeout=30, ack_at=ack_at)  # type: ignore[arg-type]
    sink = ModuleSink(model, staged=True, swap=swap)  # type: ignore[arg-type]
    acked: dict[int, int | None] = {}  # version sent -> current_version when its ack came
    done = {2: anyio.Event(), 3: anyio.Event()}
    async with (
        WeightReceiver(sink, config=config) as receiver,
        WeightSender(receiver.endpoint, config=SenderConfig(buffer_bytes=16 << 10)) as sender,
    ):

        async def send(version: int) -> None:
            await sender.send(weights(float(version)), version=version)
            acked[version] = receiver.current_version
            done[version].set()

        probes = [0]
        stop = anyio.Event()

        async def probe() -> None:  # throughout: what a lease reports is what it reads
            while not stop.is_set():
                async with receiver.serving() as seen:
                    assert seen == receiver.current_version
                    before = reads(model)
                    await anyio.sleep(0)  # let the receiver run mid-request
                    assert before == reads(model) == {float(seen or 0)}
                    probes[0] += 1
                await anyio.sleep(0.001)

        await sender.send(weights(1.0), version=1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            async with receiver.serving() as version:
                tg.start_soon(send, 2)
                with anyio.fail_after(10):
                    await swap_waits(receiver)  # version 2 is staged; the lease holds it back
                    if ack_at == "staged":
                        await done[2].wait()  # the ack came while the lease is held
                assert version == receiver.current_version == 1
                assert reads(model) == {1.0}  # the weights read are still version 1's
                if ack_at == "staged":
                    assert acked[2] == 1  # acknowledged before it went live
                    tg.start_soon(send, 3)  # its stream waits for version 2's swap
                    await anyio.wait_all_tasks_blocked()
                    assert not done[3].is_set()
                else:
                    await anyio.wait_all_tasks_blocked()
                    assert not done[2].is_set()  # no ack while the lease holds the swap
            with anyio.fail_after(10):
                await receiver.wait_for_version(2, timeout=10)
                async with receiver.serving() as version:
                    assert version is not None
                    assert reads(model) == {float(version)}
                if ack_at == "staged":
                    await done[3].wait()
            stop.set()
        if ack_at == "live":
            assert acked[2] == 2  # acknowledged once live
        else:
            assert acked[3] in (2, 3)  # acknowledged when staged: live a moment later
            await receiver.wait_for_version(3, timeout=10)
            assert reads(model) == {3.0}
    assert probes[0] > 0
    assert receiver.current_version == (3 if ack_at == "staged" else 2)
    assert receiver.swap_stats.committed == (3 if ack_at == "staged" else 2)
    assert receiver.swap_stats.longest_wait > 0


async def test_a_version_acked_at_staging_but_held_back_past_the_bound_is_dropped() -> None:
    model = weights(1.0)
    config = ReceiverConfig(swap_timeout=0.2, ack_at="staged")
    async with (
        WeightReceiver(ModuleSink(model, staged=True), config=config) as receiver,
        WeightSender(receiver.endpoint) as sender,
    ):
        await sender.send(weights(1.0), version=1)
        async with receiver.serving() as version:
            assert version == 1
            await sender.send(weights(2.0), version=2)  # acknowledged: staged
            with anyio.fail_after(10):
                while receiver.swap_stats.dropped == 0:  # held past swap_timeout: dropped
                    await receiver._leases.changed()
            assert reads(model) == {1.0}
        assert receiver.current_version == 1
        assert receiver.servable  # nothing was touched
        assert "read leases still held" in str(receiver.last_failure)
        await sender.send(weights(3.0), version=3)
        assert await receiver.wait_for_version(3, timeout=10) == 3  # live just after its ack
        assert reads(model) == {3.0}


def test_ack_at_is_checked() -> None:
    with pytest.raises(ValueError, match="ack_at"):
        ReceiverConfig(ack_at="never")  # type: ignore[arg-type]
