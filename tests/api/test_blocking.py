"""BackgroundReceiver: a receiver in a background thread, driven from synchronous code."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import anyio
import pytest
import torch
import zmq

from aiosync import (
    AiosyncError,
    BackgroundReceiver,
    ModuleSink,
    SyncTimeoutError,
    UsageError,
    WeightSender,
)
from aiosync.channels.base import Channel
from aiosync.compat.nemo_rl import stream_weights_via_ipc_zmq_impl
from aiosync.runtime import run

pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def receiver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiosync-receiver"]


def stream(endpoint: str, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """What a synchronous trainer does: NeMo-RL's blocking call on a DEALER socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        stream_weights_via_ipc_zmq_impl(pairs, 4096, sock, 0, "policy")
    finally:
        sock.close(linger=0)
        ctx.term()


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_two_versions_from_a_sync_trainer_arrive_bit_exact() -> None:
    trainer, engine = model(), model()
    commits: list[int] = []
    with BackgroundReceiver(engine, on_commit=commits.append) as receiver:
        assert receiver.current_version is None
        assert receiver.servable
        stream(receiver.endpoint, trainer.named_parameters())
        first = receiver.wait_for_version(0, timeout=10)
        assert same(trainer, engine)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        stream(receiver.endpoint, trainer.named_parameters())
        assert receiver.wait_for_version(first + 1, timeout=10) == first + 1
        assert same(trainer, engine)
        assert receiver.failures == []
        assert receiver_threads()
    assert not receiver_threads()
    assert not receiver.running
    assert sorted(commits)[-1] == first + 1


def test_a_load_weights_callback_and_a_trainer_thread() -> None:
    trainer = model()
    got: dict[str, torch.Tensor] = {}

    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            got[name] = tensor.clone()

    with BackgroundReceiver(load_weights) as receiver:
        sender = threading.Thread(
            target=stream, args=(receiver.endpoint, list(trainer.named_parameters()))
        )
        sender.start()
        try:
            receiver.wait_for_version(0, timeout=10)
        finally:
            sender.join(timeout=10)
    expected = dict(trainer.named_parameters())
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_waiting_for_a_version_nobody_sends_times_out() -> None:
    with BackgroundReceiver(model()) as receiver:
        with pytest.raises(SyncTimeoutError, match=r"still at version None") as info:
            receiver.wait_for_version(0, timeout=0.2)
        assert info.value.version == 0
        assert receiver.endpoint in str(info.value)
    assert not receiver_threads()


def test_a_refused_endpoint_surfaces_at_entry() -> None:
    receiver = BackgroundReceiver(model(), "tcp://0.0.0.0:0")
    with pytest.raises(AiosyncError, match=r"tcp://0\.0\.0\.0:0 needs CURVE keys"):
        receiver.__enter__()
    assert not receiver_threads()
    assert not receiver.running


class Boom(Exception):
    """An error no part of aiosync raises."""


class BreakingListener:
    """A listener whose ``accept`` fails once ``broken`` is set: the loop's error."""

    def __init__(self) -> None:
        self.broken = threading.Event()
        self.closed = False

    @property
    def endpoint(self) -> str:
        return "fake://breaking"

    async def accept(self) -> Channel:
        await anyio.to_thread.run_sync(self.broken.wait)
        raise Boom("accept broke")

    async def aclose(self) -> None:
        self.closed = True


def wait_until_stopped(receiver: BackgroundReceiver) -> None:
    deadline = time.monotonic() + 10
    while receiver.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not receiver.running


def test_an_error_that_ends_the_loop_is_raised_by_the_next_call() -> None:
    listener = BreakingListener()
    with BackgroundReceiver(model(), listener) as receiver:
        listener.broken.set()
        with pytest.raises(AiosyncError, match=r"fake://breaking.*Boom") as info:
            receiver.wait_for_version(0, timeout=10)
        assert isinstance(info.value.__cause__, Boom)
        with pytest.raises(UsageError, match="not running"):  # raised once, then refused
            receiver.wait_for_version(0, timeout=10)
    assert not receiver_threads()


def test_a_loop_error_is_raised_on_exit_when_no_call_saw_it() -> None:
    listener = BreakingListener()
    receiver = BackgroundReceiver(model(), listener)
    receiver.__enter__()
    listener.broken.set()
    wait_until_stopped(receiver)
    with pytest.raises(AiosyncError, match="Boom"):
        receiver.__exit__(None, None, None)
    assert not receiver_threads()


def test_a_loop_error_does_not_replace_the_blocks_own_error() -> None:
    listener = BreakingListener()
    receiver = BackgroundReceiver(model(), listener)
    receiver.__enter__()
    listener.broken.set()
    wait_until_stopped(receiver)
    own = KeyError("the block's own")
    receiver.__exit__(KeyError, own, None)  # the with statement then re-raises its own
    assert any("Boom" in note for note in own.__notes__)
    assert not receiver_threads()


def test_what_is_not_a_sink_is_refused() -> None:
    with pytest.raises(UsageError, match="load_weights"):
        BackgroundReceiver(42)  # type: ignore[arg-type]


def test_a_receiver_is_entered_once() -> None:
    receiver = BackgroundReceiver(model())
    with receiver, pytest.raises(UsageError, match="once"):
        receiver.__enter__()


def test_a_worker_thread_pins_a_version_with_a_blocking_lease() -> None:
    model = {"w": torch.zeros(64)}
    with BackgroundReceiver(ModuleSink(model, staged=True)) as receiver:
        endpoint = receiver.endpoint

        def send(version: int) -> None:
            async def main() -> None:
                async with WeightSender(endpoint) as sender:
                    await sender.send({"w": torch.full((64,), float(version))}, version=version)

            run(main)

        send(1)
        with receiver.serving() as version:
            assert version == 1
            trainer = threading.Thread(target=send, args=(2,))
            trainer.start()
            trainer.join(0.5)  # the new version waits for this lease
            assert receiver.current_version == 1
            assert torch.equal(model["w"], torch.full((64,), 1.0))
        trainer.join(30)
        assert receiver.wait_for_version(2, timeout=30) == 2
        assert torch.equal(model["w"], torch.full((64,), 2.0))


def test_a_blocking_lease_needs_a_staged_sink() -> None:
    with (
        BackgroundReceiver({"w": torch.zeros(3)}) as receiver,
        pytest.raises(UsageError, match="staged"),
        receiver.serving(),
    ):
        pass
