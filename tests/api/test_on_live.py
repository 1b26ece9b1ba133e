"""The ``on_live`` hook: run under the swap, after a version is live, before any lease on it.

Also the Subscriber's reads of its receiver, and the server's ``late_join`` metric (issue 25,
items 6 and 10).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from aiosync import (
    BackgroundReceiver,
    ModuleSink,
    ReceiverConfig,
    SenderConfig,
    SyncTimeoutError,
    WeightReceiver,
    WeightSender,
)
from aiosync.engine.live_hook import OnLive, is_async
from aiosync.runtime import run
from aiosync.server import ServerConfig, Subscriber, WeightServer

NAMES = [f"layer.{i}" for i in range(4)]
SMALL = SenderConfig(buffer_bytes=16 << 10, timeout=60)  # above swap_timeout
WAIT = 30.0
SINKS = ["in_place", "copy", "pointer"]
STAGED = ["copy", "pointer"]
KINDS = ["sync", "async"]


def weights(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full((4096,), value) for name in NAMES}


def reads(model: dict[str, torch.Tensor]) -> set[float]:
    return {float(v) for t in model.values() for v in (t[0], t[-1])}


def sink(model: dict[str, torch.Tensor], kind: str) -> ModuleSink:
    if kind == "in_place":
        return ModuleSink(model)
    return ModuleSink(model, staged=True, swap=kind)  # type: ignore[arg-type]


def hook_of(kind: str, body: Callable[[int], None]) -> OnLive:
    """``body`` as a plain function (run in a worker thread) or as an ``async def``."""
    if kind == "sync":
        return body

    async def hook(version: int) -> None:
        body(version)

    return hook


class Gate:
    """Holds the hook of one version until released; callable from a thread or the loop."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned: list[int] = []  # versions whose hook returned, in order

    def hook(self, kind: str) -> OnLive:
        def enter(version: int) -> bool:
            if version == self.version:
                self.entered.set()
                return True
            return False

        if kind == "sync":

            def blocking(version: int) -> None:
                if enter(version):
                    assert self.release.wait(WAIT)
                self.returned.append(version)

            return blocking

        async def awaited(version: int) -> None:
            if enter(version):
                while not self.release.is_set():  # the loop goes on meanwhile
                    await anyio.sleep(0.005)
            self.returned.append(version)

        return awaited

    async def wait_entered(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, WAIT)


def test_a_hook_is_sync_or_async() -> None:
    class Awaited:
        async def __call__(self, version: int) -> None:
            pass

    async def function(version: int) -> None:
        pass

    assert is_async(function)
    assert is_async(Awaited())
    assert not is_async(print)
    assert not is_async(lambda version: None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", SINKS)
async def test_the_hook_sees_the_new_weights_before_anyone_hears_of_them(
    where: str, kind: str
) -> None:
    model = weights(0.0)
    seen: list[tuple[int, int | None, set[float]]] = []

    def body(version: int) -> None:
        seen.append((version, receiver.current_version, reads(model)))

    receiver = WeightReceiver(sink(model, where), on_live=hook_of(kind, body))
    async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
        for version in (1, 2):
            await sender.send(weights(float(version)), version=version)
            assert len(seen) == version  # the ack (ack_at="live") came after the hook
    assert seen == [(1, None, {1.0}), (2, 1, {2.0})]  # the weights are in; current after
    assert receiver.servable
    assert receiver.swap_stats.on_live_error is None


@pytest.mark.parametrize("ack_at", ["live", "staged"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("swap", STAGED)
async def test_no_lease_on_the_new_version_starts_before_the_hook_returns(
    swap: str, kind: str, ack_at: str
) -> None:
    model = weights(1.0)
    gate = Gate(version=2)
    config = ReceiverConfig(swap_timeout=WAIT, ack_at=ack_at)  # type: ignore[arg-type]
    receiver = WeightReceiver(sink(model, swap), config=config, on_live=gate.hook(kind))
    leased: list[tuple[int | None, list[int], set[float]]] = []
    acked = anyio.Event()
    async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
        await sender.send(weights(1.0), version=1)
        await receiver.wait_for_version(1, WAIT)  # acked at staging: live a moment later
        assert gate.returned == [1]

        async def send() -> None:
            await sender.send(weights(2.0), version=2)
            acked.set()

        async def lease() -> None:
            async with receiver.serving() as version:
                leased.append((version, list(gate.returned), reads(model)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await gate.wait_entered()
            assert reads(model) == {2.0}  # the hook runs after the swap
            assert receiver.current_version == 1  # and the version is current once it returns
            with pytest.raises(SyncTimeoutError):
                await receiver.wait_for_version(2, timeout=0.05)
            tg.start_soon(lease)  # races the hook
            await anyio.wait_all_tasks_blocked()
            assert leased == []  # it waits for the hook
            if ack_at == "live":
                assert not acked.is_set()  # nor is the sender told before the hook returns
            else:
                with anyio.fail_after(WAIT):
                    await acked.wait()  # acknowledged when staged, before the hook
                await anyio.wait_all_tasks_blocked()
                assert leased == []
            gate.release.set()
    assert leased == [(2, [1, 2], {2.0})]
    assert receiver.swap_stats.last_on_live > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("swap", STAGED)
async def test_requests_racing_many_versions_never_see_one_before_its_hook(
    swap: str, kind: str
) -> None:
    model = weights(0.0)
    returned: set[int] = set()
    checked = [0]

    def reset(version: int) -> None:
        time.sleep(0.002)  # a cache reset takes a while
        returned.add(version)

    async def reset_async(version: int) -> None:
        await anyio.sleep(0.002)  # requests run meanwhile
        returned.add(version)

    hook: OnLive = reset if kind == "sync" else reset_async
    receiver = WeightReceiver(sink(model, swap), on_live=hook)

    async def request() -> None:
        async with receiver.serving() as version:
            if version is not None:
                assert version in returned, (version, sorted(returned))
                assert reads(model) == {float(version)}
                checked[0] += 1
            await anyio.sleep(0.001)

    async def requests(stop: anyio.Event) -> None:
        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                for _ in range(3):
                    tg.start_soon(request)
                await anyio.sleep(0.001)

    async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(requests, stop)
            for version in range(1, 7):
                await sender.send(weights(float(version)), version=version)
            stop.set()
    assert returned == set(range(1, 7))
    assert checked[0] > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", SINKS)
async def test_a_hook_that_raises_leaves_the_version_live_and_the_engine_unservable(
    where: str, kind: str
) -> None:
    model = weights(0.0)
    armed = [True]

    def body(version: int) -> None:
        if armed[0]:
            raise RuntimeError("cache reset failed")

    receiver = WeightReceiver(sink(model, where), on_live=hook_of(kind, body))
    async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
        report = await sender.send(weights(1.0), version=1)  # committed: it is live
        assert report.committed
        assert receiver.current_version == 1
        assert reads(model) == {1.0}
        assert not receiver.servable  # what the engine derived may be stale
        error = receiver.swap_stats.on_live_error
        assert error is not None
        assert "cache reset failed" in error
        assert "version 1" in error
        assert receiver.swap_stats.on_live_failures == 1
        assert receiver.failures == []  # the stream did commit
        if where != "in_place":
            async with receiver.serving() as version:  # leases go on
                assert version == 1
        armed[0] = False
        await sender.send(weights(2.0), version=2)
        assert receiver.servable  # a later hook returned
        assert receiver.swap_stats.on_live_error is None
        assert receiver.swap_stats.on_live_failures == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_hook_past_swap_timeout_is_a_failure_and_the_version_stays_live(
    kind: str,
) -> None:
    model = weights(0.0)
    release = threading.Event()

    def stuck(version: int) -> None:
        release.wait(WAIT)

    async def stuck_async(version: int) -> None:
        await anyio.sleep(WAIT)  # cancelled at the timeout

    hook: OnLive = stuck if kind == "sync" else stuck_async
    config = ReceiverConfig(swap_timeout=0.2)
    receiver = WeightReceiver(ModuleSink(model, staged=True), config=config, on_live=hook)
    try:
        async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
            await sender.send(weights(1.0), version=1)
            assert receiver.current_version == 1
            assert reads(model) == {1.0}
            assert not receiver.servable
            assert "did not return within 0.2s" in str(receiver.swap_stats.on_live_error)
            async with receiver.serving() as version:
                assert version == 1
    finally:
        release.set()  # the abandoned thread ends


async def test_a_sync_hook_returning_a_coroutine_is_a_failure_saying_so() -> None:
    async def reset(version: int) -> None:
        pass

    model = weights(0.0)
    receiver = WeightReceiver(ModuleSink(model), on_live=lambda version: reset(version))
    async with receiver, WeightSender(receiver.endpoint, config=SMALL) as sender:
        await sender.send(weights(1.0), version=1)
        assert receiver.current_version == 1
        assert "make on_live an async def" in str(receiver.swap_stats.on_live_error)
        assert not receiver.servable


def send_in_thread(endpoint: str, version: int) -> threading.Thread:
    """A trainer in a thread of its own, with its own loop, sending one version."""

    def main() -> None:
        async def body() -> None:
            async with WeightSender(endpoint, config=SMALL) as sender:
                await sender.send(weights(float(version)), version=version)

        run(body)

    thread = threading.Thread(target=main)
    thread.start()
    return thread


@pytest.mark.usefixtures("no_leaked_threads")
@pytest.mark.parametrize("kind", KINDS)
def test_a_background_receivers_blocking_lease_waits_for_the_hook(kind: str) -> None:
    model = weights(0.0)
    gate = Gate(version=2)
    leased: list[tuple[int | None, list[int], set[float]]] = []
    hook = gate.hook(kind)
    with BackgroundReceiver(ModuleSink(model, staged=True), on_live=hook) as receiver:
        send_in_thread(receiver.endpoint, 1).join(WAIT)
        assert receiver.wait_for_version(1, timeout=WAIT) == 1
        assert gate.returned == [1]
        trainer = send_in_thread(receiver.endpoint, 2)
        try:
            assert gate.entered.wait(WAIT)

            def read() -> None:
                with receiver.serving() as version:
                    leased.append((version, list(gate.returned), reads(model)))

            reader = threading.Thread(target=read)
            reader.start()
            reader.join(0.3)
            assert reader.is_alive()  # the lease waits for the hook
            assert leased == []
            assert receiver.current_version == 1  # current once the hook returns
        finally:
            gate.release.set()
        reader.join(WAIT)
        trainer.join(WAIT)
        assert receiver.servable
    assert leased == [(2, [1, 2], {2.0})]


# --------------------------------------------------------------------------------------
# the Subscriber's reads of its receiver; the late_join metric
# --------------------------------------------------------------------------------------


async def test_a_subscriber_reads_what_its_receiver_reads_and_passes_on_live() -> None:
    model = weights(0.0)
    seen: list[tuple[int, int | None]] = []
    async with WeightServer(ServerConfig(timeout=WAIT)) as server:

        async def on_live(version: int) -> None:
            seen.append((version, sub.current_version))  # current once it returns

        sub = Subscriber(
            server.control_endpoint, ModuleSink(model, staged=True), name="e", on_live=on_live
        )
        async with sub, WeightSender(server.publish_endpoint, config=SMALL) as sender:
            assert sub.endpoint == sub.receiver.endpoint
            assert sub.endpoint.startswith("ipc://")
            assert sub.servable
            await sender.send(weights(1.0), version=1)
            assert await sub.wait_for_version(1, WAIT) == 1
            assert seen == [(1, None)]
            assert sub.swap_stats is sub.receiver.swap_stats
            assert sub.swap_stats.committed == 1
            assert sub.failures == sub.receiver.failures == []
            assert sub.servable


def sample(server: WeightServer, name: str) -> Any:
    return server.metrics.registry.get_sample_value(
        f"aiosync_stage_seconds_{name}", {"stage": "late_join"}
    )


async def test_late_join_does_not_count_the_wait_for_a_first_publish() -> None:
    pytest.importorskip("prometheus_client")
    async with WeightServer(ServerConfig(timeout=WAIT)) as server:
        assert server.metrics is not None
        model = weights(0.0)
        async with (
            Subscriber(server.control_endpoint, ModuleSink(model), name="early"),
            WeightSender(server.publish_endpoint, config=SMALL) as sender,
        ):
            await anyio.sleep(0.3)  # subscribed; nothing to send it yet
            published = time.perf_counter()
            await sender.send(weights(1.0), version=1)
            await server.wait_for(1, WAIT)
            served = time.perf_counter()
        assert sample(server, "count") == 1
        assert sample(server, "sum") <= served - published  # not since it subscribed
