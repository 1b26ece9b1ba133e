"""Busy polling: a waiting side looks at its socket on every loop turn, for a bounded time.

No test measures time: each checks what is delivered, that other tasks run meanwhile, and
who turns the polling on and off.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import torch
import zmq
import zmq.asyncio

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightReceiver, WeightSender
from aiosync.channels.busy_poll import CUDA_BUSY_POLL, poll_briefly, resolve_busy_poll
from aiosync.channels.zmq import ZmqChannel, ZmqListener
from aiosync.core.layout import TensorSpec
from tests.channel_helpers import GUARD, recv, serving
from tests.models import assert_same, mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, timeout=10)


def test_the_budget_is_the_configured_one_or_by_device() -> None:
    assert resolve_busy_poll(None, cuda=True) == CUDA_BUSY_POLL > 0
    assert resolve_busy_poll(None, cuda=False) == 0.0
    assert resolve_busy_poll(0.0, cuda=True) == 0.0
    assert resolve_busy_poll(0.5, cuda=False) == 0.5


@pytest.mark.parametrize("config", [SenderConfig, ReceiverConfig])
def test_a_negative_budget_is_refused(config: type) -> None:
    with pytest.raises(ValueError, match="busy_poll"):
        config(busy_poll=-0.001)


async def _pair() -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return ctx, router, dealer


async def test_poll_briefly_takes_a_message_that_arrives_while_other_tasks_run() -> None:
    ctx, router, dealer = await _pair()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if ticks == 50:
                await dealer.send(b"late")
            await anyio.lowlevel.checkpoint()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            with anyio.fail_after(GUARD):
                frames = await poll_briefly(router, GUARD)
            tg.cancel_scope.cancel()
        assert frames is not None
        assert frames[-1] == b"late"
        assert ticks >= 50  # the loop stayed free: the ticker ran while we polled
    finally:
        ctx.destroy(linger=0)


async def test_poll_briefly_looks_once_without_budget_and_gives_up_after_it() -> None:
    ctx, router, dealer = await _pair()
    try:
        assert await poll_briefly(router, 0.0) is None
        assert await poll_briefly(router, 0.005) is None  # nothing came within the budget
        await dealer.send(b"waiting")
        with anyio.fail_after(GUARD):
            await router.poll(zmq.POLLIN)  # arrived (a wait that does not consume it)
        frames = await poll_briefly(router, 0.0)
        assert frames is not None
        assert frames[-1] == b"waiting"
        assert await poll_briefly(router, 0.0) is None  # taken, not peeked
    finally:
        ctx.destroy(linger=0)


async def test_a_polling_channel_takes_the_reply_and_keeps_the_loop_free() -> None:
    async with serving(ZmqListener.open()) as served:
        channel = ZmqChannel.connect(served.endpoint)
        channel.busy_poll = GUARD
        try:
            await channel.send(b"hello")
            peer = await served.next_peer()
            assert await recv(peer) == b"hello"
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    if ticks == 50:
                        await peer.send(b"reply")
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                assert await recv(channel) == b"reply"
                tg.cancel_scope.cancel()
            assert ticks >= 50
        finally:
            await channel.aclose()


async def test_turning_polling_on_wakes_a_sleeping_listener_and_loses_nothing() -> None:
    async with serving(ZmqListener.open()) as served:
        listener = served.listener
        channel = ZmqChannel.connect(served.endpoint)
        try:
            await channel.send(b"0")
            peer = await served.next_peer()
            assert await recv(peer) == b"0"
            for _ in range(20):  # the accept loop goes back to sleep on the socket
                await anyio.lowlevel.checkpoint()
            assert listener._sleeping is not None
            listener.busy_poll = GUARD
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert listener._sleeping is None  # polling now, not asleep
            for payload in (b"1", b"2", b"3"):
                await channel.send(payload)
            assert [await recv(peer) for _ in range(3)] == [b"1", b"2", b"3"]
            listener.busy_poll = 0.0  # the current poll runs out its budget; nothing lost
            await channel.send(b"4")
            assert await recv(peer) == b"4"
        finally:
            await channel.aclose()


async def test_an_engine_polls_only_while_a_version_streams() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    seen: list[float] = []
    receiver: WeightReceiver

    class Watching(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
            assert receiver._polled is not None
            seen.append(receiver._polled[0].busy_poll)
            super().apply_bucket(bucket, specs)

    receiver = WeightReceiver(Watching(target), config=ReceiverConfig(busy_poll=0.25))
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=10, busy_poll=0.25)
    async with receiver, WeightSender(receiver.endpoint, config=config) as sender:
        owned = sender._owned[sender.engines[0]]
        assert isinstance(owned, ZmqChannel)
        assert owned.busy_poll == 0.25
        await sender.send(weights.items(), version=0)
        assert receiver._polled is not None
        listener = receiver._polled[0]
        with anyio.fail_after(GUARD):
            while listener.busy_poll:  # the serving loop turns it off after the commit
                await anyio.sleep(0.01)
    assert len(seen) > 1
    assert set(seen) == {0.25}
    assert_same(target, {k: v.contiguous() for k, v in weights.items()})


async def test_on_the_cpu_nothing_polls_by_default() -> None:
    weights = mixed_weights()
    async with (
        WeightReceiver(ModuleSink(zeros_like(weights))) as receiver,
        WeightSender(receiver.endpoint, config=SMALL) as sender,
    ):
        owned = sender._owned[sender.engines[0]]
        assert isinstance(owned, ZmqChannel)
        assert owned.busy_poll == 0.0
        assert receiver._polled is None
        await sender.send(weights.items(), version=0)
        assert receiver.current_version == 0
