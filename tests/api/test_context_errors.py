"""Errors leave every public context manager as themselves, never wrapped in a group.

For each of them: an exception raised in the body (the user's own, and one a library call in
the body raised), a failure of the library's own work, and cancellation. A user's
``except PeerGoneError`` around the block must match.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from aiosync import (
    BackgroundReceiver,
    FleetError,
    MismatchError,
    ModuleSink,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SenderConfig,
    SyncTimeoutError,
    WeightReceiver,
    WeightSender,
)
from aiosync.core.exception_groups import collapse
from aiosync.handles import ChannelHandle
from aiosync.planes.collective import CollectiveOptions
from aiosync.server import ServerClient, ServerConfig, Subscriber, WeightServer
from aiosync.trainer.collective import CollectiveSender

SMALL = SenderConfig(buffer_bytes=64 << 10, num_buffers=2, timeout=20)


class Mine(Exception):
    """The user's own exception."""


def weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(4)}


@asynccontextmanager
async def receiver() -> AsyncIterator[WeightReceiver]:
    async with WeightReceiver(ModuleSink(weights())) as rx:
        yield rx


@asynccontextmanager
async def sender() -> AsyncIterator[WeightSender]:
    async with receiver() as rx, WeightSender(rx.endpoint, config=SMALL) as tx:
        yield tx


@asynccontextmanager
async def server() -> AsyncIterator[WeightServer]:
    async with WeightServer(ServerConfig(timeout=20)) as srv:
        yield srv


@asynccontextmanager
async def subscriber() -> AsyncIterator[Subscriber]:
    async with server() as srv, Subscriber(srv.control_endpoint, ModuleSink(weights())) as sub:
        yield sub


@asynccontextmanager
async def client() -> AsyncIterator[ServerClient]:
    async with server() as srv, ServerClient(srv.control_endpoint, timeout=20) as c:
        yield c


@asynccontextmanager
async def collective() -> AsyncIterator[CollectiveSender]:
    options = CollectiveOptions(engines=1, timeout=20)
    async with CollectiveSender((), collective=options, config=SMALL) as tx:
        yield tx


@asynccontextmanager
async def handle() -> AsyncIterator[ChannelHandle]:
    async with server() as srv:
        h = ChannelHandle.connect(srv.control_endpoint, name="engine-0")
        async with h:
            yield h


Opener = Callable[[], AbstractAsyncContextManager[Any]]
OPENERS: dict[str, Opener] = {
    "WeightReceiver": receiver,
    "WeightSender": sender,
    "WeightServer": server,
    "Subscriber": subscriber,
    "ServerClient": client,
    "CollectiveSender": collective,
    "ChannelHandle": handle,
}


@pytest.mark.parametrize("name", OPENERS)
async def test_the_users_exception_leaves_as_itself(name: str) -> None:
    with anyio.fail_after(60), pytest.raises(Mine) as caught:
        async with OPENERS[name]():
            raise Mine("from the body")
    assert type(caught.value) is Mine
    assert str(caught.value) == "from the body"


@pytest.mark.parametrize("name", OPENERS)
async def test_an_aiosync_error_raised_in_the_body_is_catchable(name: str) -> None:
    caught: PeerGoneError | None = None
    with anyio.fail_after(60):
        try:
            async with OPENERS[name]():
                raise PeerGoneError("engine vanished", peer="engine-7")
        except PeerGoneError as exc:  # the trainer's reconnect path
            caught = exc
    assert caught is not None
    assert caught.peer == "engine-7"


@pytest.mark.parametrize("name", OPENERS)
async def test_cancellation_leaves_as_cancellation(name: str) -> None:
    entered = anyio.Event()

    async def body() -> None:
        async with OPENERS[name]():
            entered.set()
            await anyio.sleep(60)

    task = asyncio.get_running_loop().create_task(body())
    with anyio.fail_after(60):
        await entered.wait()
    task.cancel()
    with anyio.fail_after(60), pytest.raises(asyncio.CancelledError):
        await task

    with anyio.fail_after(60), anyio.move_on_after(0.2) as scope:  # anyio's own scopes too
        async with OPENERS[name]():
            await anyio.sleep(60)
    assert scope.cancelled_caught


async def test_a_refused_version_raised_by_send_leaves_the_sender_as_itself() -> None:
    async with receiver() as rx:
        with anyio.fail_after(60), pytest.raises(RejectedError, match="no such parameter"):
            async with WeightSender(rx.endpoint, config=SMALL) as tx:
                await tx.send({"nope": torch.zeros(3)}, version=0)


class BreakingListener:
    """A listener whose accept fails once the body is running: a failure of the library's work."""

    endpoint = "ipc:///nowhere/breaking"

    def __init__(self) -> None:
        self.go = anyio.Event()

    async def accept(self) -> Any:
        await self.go.wait()
        raise ProtocolError("listener broke", peer="the listener")

    async def aclose(self) -> None:
        return None


async def test_a_receivers_own_task_failure_leaves_as_that_error() -> None:
    listener = BreakingListener()

    async def body() -> None:
        async with WeightReceiver(ModuleSink(weights()), listener):  # type: ignore[arg-type]
            listener.go.set()
            await anyio.sleep(30)

    with anyio.fail_after(60), pytest.raises(ProtocolError, match="listener broke") as caught:
        await body()
    assert type(caught.value) is ProtocolError


def test_background_receiver_lets_the_users_exception_out_as_itself() -> None:
    with pytest.raises(Mine), BackgroundReceiver(ModuleSink(weights())):
        raise Mine("from the body")
    with pytest.raises(PeerGoneError), BackgroundReceiver(ModuleSink(weights())):
        raise PeerGoneError("engine vanished")


@pytest.mark.parametrize("fail_at", [0, 1, 5, 15])
async def test_a_generators_own_error_is_the_cause_of_the_send_failure(fail_at: int) -> None:
    """Issue 26.10: wherever the sender's read of a generator fails, the user's error is the
    cause (not an exception group), named in the message."""
    model = {f"t{i}": torch.zeros(1000) for i in range(20)}

    def tensors() -> Any:
        for i in range(20):
            if i == fail_at:
                raise Mine(f"bug at {i}")
            yield f"t{i}", torch.ones(1000)

    config = SenderConfig(buffer_bytes=8192, timeout=20)
    async with (
        WeightReceiver(ModuleSink(model)) as rx,
        WeightSender(rx.endpoint, config=config) as tx,
    ):
        with anyio.fail_after(60), pytest.raises(MismatchError) as caught:
            await tx.send(tensors(), version=0)
    assert type(caught.value.__cause__) is Mine
    assert f"Mine: bug at {fail_at}" in str(caught.value)


# --- the rule, without any process --------------------------------------------------------


def test_collapse_prefers_the_body_then_ours_then_others() -> None:
    body = Mine("body")
    ours = SyncTimeoutError("slow", peer="e0")
    group = BaseExceptionGroup("g", [asyncio.CancelledError(), ExceptionGroup("n", [body, ours])])
    assert collapse(group, body) is body
    assert any("slow" in note for note in body.__notes__)

    bug = KeyError("k")
    assert collapse(ExceptionGroup("g", [bug, ours]), asyncio.CancelledError()) is ours
    assert collapse(ExceptionGroup("g", [bug]), asyncio.CancelledError()) is bug
    assert collapse(ExceptionGroup("g", [ours]), asyncio.CancelledError()) is ours

    cancelled = asyncio.CancelledError()
    assert collapse(BaseExceptionGroup("g", [asyncio.CancelledError()]), cancelled) is cancelled


def test_collapse_names_each_engine_when_several_failed() -> None:
    a = SyncTimeoutError("no ack", peer="e0", version=3)
    b = PeerGoneError("gone", peer="e1", version=3)
    fleet = collapse(ExceptionGroup("g", [a, ExceptionGroup("n", [b])]))
    assert isinstance(fleet, FleetError)
    assert fleet.failures == {"e0": a, "e1": b}
    assert fleet.version == 3
    assert "e0" in str(fleet)
    assert "e1" in str(fleet)
    same_peer = collapse(ExceptionGroup("g", [a, SyncTimeoutError("again", peer="e0")]))
    assert same_peer is a
