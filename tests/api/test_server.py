"""The weight server in one process: publish through WeightSender, subscribers, late joiners,
named versions, bounded lag, retention and the control channel's hostile input.

Everything runs on the real channels (ZMQ over ipc) and real shared memory.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightSender
from aiosync.channels.zmq import ZmqChannel
from aiosync.core.errors import RejectedError, SyncTimeoutError
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import Limits
from aiosync.server import RetentionPolicy, ServerClient, ServerConfig, Subscriber, WeightServer
from aiosync.server import messages as m

WAIT = 30.0


def model(version: int) -> dict[str, torch.Tensor]:
    """A small model whose every value says its version."""
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.weight": torch.randn(32, 32, generator=g),
        "layer.0.bias": torch.full((32,), float(version)),
        "big": torch.randn(70_000, generator=g),  # chunked through 64 KiB buffers
    }


def empty() -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in model(0).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SMALL = SenderConfig(buffer_bytes=64 << 10, num_buffers=2, timeout=WAIT)


async def test_publish_subscribe_late_join_and_named_versions() -> None:
    config = ServerConfig(retention=RetentionPolicy(max_versions=3), timeout=WAIT)
    async with WeightServer(config) as server:
        assert not server.ready
        assert server.newest is None
        early = empty()
        async with (
            Subscriber(server.control_endpoint, ModuleSink(early), name="early") as sub,
            WeightSender(server.publish_endpoint, config=SMALL) as sender,
        ):
            assert not sub.ready  # not ready until a first version commits
            for version in range(3):
                report = await sender.send(model(version), version=version)
                assert report.committed  # the server holds it
                assert server.newest == version
            await server.wait_for(2, WAIT)
            assert sub.current_version == 2
            assert same(early, model(2))
            assert server.store.versions == [0, 1, 2]

            late = empty()  # a late joiner: gets the newest at once, no publisher involved
            rebasing = ReceiverConfig(limits=Limits(allow_rebase=True))
            async with Subscriber(
                server.control_endpoint, ModuleSink(late), name="late", config=rebasing
            ) as joiner:
                assert await joiner.wait_for_version(2, WAIT) == 2
                assert same(late, model(2))
                assert await joiner.fetch(0, WAIT) == 0  # a named, older retained version
                assert same(late, model(0))
                with pytest.raises(RejectedError, match="not retained"):
                    await joiner.fetch(7, WAIT)
                await sender.send(model(3), version=3)  # fetched: it stays on 0
                await server.wait_for(3, WAIT, engines=["early"])
                assert joiner.current_version == 0
                await joiner.follow()
                assert await joiner.wait_for_version(3, WAIT) == 3
                assert same(late, model(3))
                await server.wait_for(3, WAIT)  # the server has recorded the commit too
                status = await joiner.client.status()
                assert {e.name: e.version for e in status.engines} == {"early": 3, "late": 3}
                assert status.retained == [1, 2, 3]  # retention by count
        assert (await server.wait_engines(0, WAIT)).engines == []  # both left, noticed


async def test_bounded_lag_is_reported_and_awaited() -> None:
    async with WeightServer(ServerConfig(timeout=WAIT)) as server:
        held = empty()
        async with (
            WeightSender(server.publish_endpoint, config=SMALL) as sender,
            Subscriber(server.control_endpoint, ModuleSink(held), name="e", max_lag=1),
            ServerClient(server.control_endpoint) as client,
        ):
            for version in range(4):
                await sender.send(model(version), version=version)
                status = await client.wait_within_bounds(WAIT)
                (engine,) = status.engines
                assert engine.max_lag == 1
                assert engine.lag is not None
                assert engine.lag <= 1
            status = await client.wait_for(3, WAIT, engines=["e"])
            assert status.engines[0].version == 3
            assert status.engines[0].lag == 0
            with pytest.raises(SyncTimeoutError):
                await client.wait_for(99, 0.2)


async def test_a_slow_engine_does_not_hold_the_publisher() -> None:
    """An engine whose sink blocks is fed at its pace; the publisher runs ahead, bounded."""
    release = __import__("threading").Event()

    class SlowSink(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
            release.wait(WAIT)
            super().apply_bucket(bucket, specs)

    config = ServerConfig(retention=RetentionPolicy(max_versions=2), timeout=WAIT)
    async with WeightServer(config) as server:
        slow, fast = empty(), empty()
        async with (
            WeightSender(server.publish_endpoint, config=SMALL) as sender,
            Subscriber(server.control_endpoint, SlowSink(slow, staged=True), name="slow"),
            Subscriber(server.control_endpoint, ModuleSink(fast), name="fast"),
        ):
            try:
                for version in range(5):  # the slow one is stuck on version 0 meanwhile
                    await sender.send(model(version), version=version)
                await server.wait_for(4, WAIT, engines=["fast"])
                assert same(fast, model(4))
                status = server.status()
                slow_state = next(e for e in status.engines if e.name == "slow")
                assert slow_state.version is None
                assert slow_state.lag == 5
                # version 0 is pinned by its transfer: retained past the count until it ends
                assert 0 in status.retained
                assert status.retained[-1] == 4
                release.set()
                await server.wait_for(4, WAIT, engines=["slow"])  # then the newest, whole
                assert same(slow, model(4))
                assert len(server.store.versions) == 2
                assert server.newest == 4
            finally:
                release.set()


async def test_byte_bound_holds_and_a_too_large_version_is_refused() -> None:
    one = sum(t.numel() * t.element_size() for t in model(0).values())
    config = ServerConfig(retention=RetentionPolicy(max_versions=5, max_bytes=one * 2 + 8192))
    async with (
        WeightServer(config) as server,
        WeightSender(server.publish_endpoint, config=SMALL) as sender,
    ):
        for version in range(4):
            await sender.send(model(version), version=version)
            assert server.store.held_bytes <= config.retention.max_bytes  # type: ignore[operator]
        assert server.store.versions == [2, 3]
        huge = {"x": torch.zeros(one)}
        with pytest.raises(RejectedError, match="cannot be retained"):
            await sender.send(huge, version=4)
        assert server.newest == 3
        assert server.store.used_bytes == server.store.book.retained_bytes  # pending dropped


async def test_control_channel_refuses_garbage_and_bad_subscriptions() -> None:
    async with WeightServer() as server:
        channel = ZmqChannel.connect(server.control_endpoint)
        try:
            await channel.send(b"\x93garbage")
            with anyio.fail_after(WAIT):
                reply = m.decode_reply(await channel.recv())
            assert isinstance(reply, m.Refused)
        finally:
            await channel.aclose()
        async with ServerClient(server.control_endpoint) as client:
            for bad in (
                m.Subscribe("x", "http://example.com"),
                m.Subscribe("x" * 1000, "ipc:///tmp/x"),
                m.Subscribe("x", "ipc:///tmp/x", max_lag=-1),
                m.Subscribe("x", "tcp://10.0.0.1:5555"),  # tcp needs keys (or loopback)
            ):
                with pytest.raises(RejectedError):
                    await client.request(bad)
            with pytest.raises(RejectedError, match="subscription"):
                await client.request(m.Fetch(0))
            assert (await client.status()).engines == []


async def test_hostile_values_in_well_formed_requests_leave_the_server_serving() -> None:
    nan = float("nan")
    async with WeightServer(ServerConfig(timeout=WAIT, max_wait=0.5)) as server:
        for request in (
            m.Wait(nan),  # clamped to 0: answered at once
            m.Wait(float("inf"), version=-(2**62), engines=["x" * 5000] * 100),  # max_wait
            m.Pull(None, nan),
            m.Get(2**62, -1, -(2**62), 2**62),  # a range: issue 29
            m.Fetch(-1),
            m.Follow(),
        ):
            async with ServerClient(server.control_endpoint) as client:
                try:
                    status = await client.request(request, timeout=WAIT)
                    assert isinstance(status, m.Status)
                except (RejectedError, SyncTimeoutError):
                    pass
        held = empty()
        async with (
            WeightSender(server.publish_endpoint, config=SMALL) as sender,
            Subscriber(server.control_endpoint, ModuleSink(held), name="after") as sub,
        ):
            await sender.send(model(1), version=1)
            assert await sub.wait_for_version(1, WAIT) == 1  # still serving
