"""The weight server's feed is a sender too: its commits carry a deadline (issue 26.9).

A subscriber whose read leases hold a version past the server's wait refuses it at the
deadline instead of making it live after the server gave up on it.
"""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightSender
from aiosync.core.engine_actions import Action, Peer
from aiosync.core.engine_session import EngineSession
from aiosync.core.wire import Commit, Message
from aiosync.pipeline.links import COMMIT_GRACE
from aiosync.server import ServerConfig, Subscriber, WeightServer

GUARD = 60  # seconds: a hang guard only, never a measured bound


def weights(value: float) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.full((4096,), value) for i in range(4)}


async def test_the_feeds_commit_carries_the_servers_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[float, Commit]] = []
    receive = EngineSession.receive

    def spying(self: EngineSession, peer: Peer, message: Message, now: float) -> list[Action]:
        if isinstance(message, Commit):
            seen.append((time.time(), message))
        return receive(self, peer, message, now)

    monkeypatch.setattr(EngineSession, "receive", spying)
    timeout = 20.0
    config = SenderConfig(buffer_bytes=64 << 10, timeout=30)
    with anyio.fail_after(GUARD):
        async with WeightServer(ServerConfig(timeout=timeout)) as server:
            sink = ModuleSink(weights(0.0), staged=True)
            async with (
                Subscriber(server.control_endpoint, sink, name="sub") as sub,
                WeightSender(server.publish_endpoint, config=config) as sender,
            ):
                await sender.send(weights(1.0), version=0)
                await sub.wait_for_version(0, GUARD)
    # the publisher's commit into the server, then the server's into the subscriber
    assert len(seen) == 2
    at, commit = seen[-1]
    assert commit.deadline is not None
    grace = min(COMMIT_GRACE, timeout / 4)
    assert at < commit.deadline <= at + timeout - grace


async def test_a_subscriber_leased_past_the_servers_wait_refuses_the_version() -> None:
    timeout = 3.0
    config = SenderConfig(buffer_bytes=64 << 10, timeout=30)
    swap = ReceiverConfig(swap_timeout=30.0)
    with anyio.fail_after(GUARD):
        async with WeightServer(ServerConfig(timeout=timeout)) as server:
            sink = ModuleSink(weights(0.0), staged=True)
            async with (
                Subscriber(server.control_endpoint, sink, name="sub", config=swap) as sub,
                WeightSender(server.publish_endpoint, config=config) as sender,
            ):
                await sender.send(weights(1.0), version=0)
                await sub.wait_for_version(0, GUARD)
                async with sub.serving() as version:
                    assert version == 0
                    await sender.send(weights(2.0), version=1)  # the server holds it
                    await anyio.sleep(timeout + 1.0)  # past the server's wait
                    assert sub.current_version == 0
                await anyio.sleep(0.5)  # the lease is gone: nothing goes live late
                assert sub.current_version == 0
                assert any("deadline" in str(f) for f in sub.failures)
