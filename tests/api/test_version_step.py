"""Version numbers: a small default step, refusals that say who set the version, rebases.

A peer allowed to send versions can move an engine ahead by at most ``max_version_step``
(1,024 by default) per version; the trainer's next versions are then refused as not newer,
naming the session that set the engine's version, and ``send(rebase=True)`` restarts the
numbering on an engine that allows it.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from aiosync import (
    ModuleSink,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.core.limits import Limits
from aiosync.core.wire import Begin
from tests.unit.test_engine_session import ack_of, connected, finish, send, stream

GUARD = 60  # seconds: a hang guard only, never a measured bound
NAMES = [f"layer.{i}" for i in range(4)]


def weights(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full((1024,), value) for name in NAMES}


def test_the_default_step_is_small() -> None:
    assert Limits().max_version_step == 1024


@pytest.mark.parametrize(("version", "ok"), [(1024 + 7, True), (1025 + 7, False)])
def test_a_version_may_jump_at_most_the_step(version: int, ok: bool) -> None:
    engine = connected(current=7)
    ack = ack_of(send(engine, Begin(version)))
    assert ack.ok is ok
    if not ok:
        assert "jumps more than 1024 past 7" in (ack.error or "")


def test_a_refusal_as_not_newer_names_the_session_that_set_the_version() -> None:
    engine = connected(peers=("hostile", "trainer"))
    stream(engine, 1030, "hostile")
    finish(engine, 1030, 2, 2, "hostile")
    assert engine.current_version == 1030
    ack = ack_of(send(engine, Begin(8), "trainer"), "trainer")
    assert not ack.ok
    assert "not newer than current 1030" in (ack.error or "")
    assert "set by trainer@hostile, session session-hostile" in (ack.error or "")


async def test_send_with_rebase_restarts_the_numbering_after_a_hostile_jump() -> None:
    limits = Limits(allow_rebase=True)
    config = ReceiverConfig(limits=limits)
    small = SenderConfig(buffer_bytes=64 * 1024, timeout=10, name="trainer")
    sink = ModuleSink(weights(0.0), staged=True)
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(sink, config=config) as rx,
            WeightSender(rx.endpoint, config=small) as trainer,
        ):
            for version in range(3):
                await trainer.send(weights(float(version)), version=version)
            hostile = SenderConfig(buffer_bytes=64 * 1024, timeout=10, name="hostile")
            async with WeightSender(rx.endpoint, config=hostile) as peer:
                jump = 2 + limits.max_version_step
                await peer.send(weights(-1.0), version=jump)
            assert rx.current_version == jump
            with pytest.raises(RejectedError, match=f"not newer than current {jump}") as info:
                await trainer.send(weights(3.0), version=3)
            assert "set by hostile@" in info.value.reason
            assert trainer.engines == [rx.endpoint]  # a refusal: still in the fleet
            # back from a checkpoint: below what both the trainer and the engine hold
            report = await trainer.send(weights(3.0), version=0, rebase=True)
            assert report.committed == [rx.endpoint]
            assert rx.current_version == 0
            assert trainer.remote_versions == {rx.endpoint: 0}
            assert (await trainer.send(weights(4.0))).version == 1  # numbering goes on
            assert rx.current_version == 1


async def test_send_with_rebase_to_an_engine_that_does_not_allow_it_is_refused() -> None:
    small = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(ModuleSink(weights(0.0), staged=True)) as rx,
            WeightSender(rx.endpoint, config=small) as sender,
        ):
            await sender.send(weights(1.0), version=5)
            with pytest.raises(RejectedError, match="does not allow restarting"):
                await sender.send(weights(1.0), version=0, rebase=True)
            assert (sender.engines, rx.current_version) == ([rx.endpoint], 5)
            assert (await sender.send(weights(2.0))).version == 6
