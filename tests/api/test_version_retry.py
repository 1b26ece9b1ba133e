"""A retry of a version an engine holds already keeps the engine in the fleet.

An engine known to hold the version is sent nothing and reported ``current``; an older
version is a plain refusal (the session stays); an engine that does leave the fleet is
named in the error that removes it.
"""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from aiosync import (
    ModuleSink,
    PeerGoneError,
    Policy,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    SyncTimeoutError,
    WeightReceiver,
    WeightSender,
)
from aiosync.core.errors import AiosyncError
from aiosync.core.layout import TensorSpec
from aiosync.core.trainer_session import FleetVote, Verdict

GUARD = 60  # seconds: a hang guard only, never a measured bound
SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)
NAMES = [f"layer.{i}" for i in range(6)]


def weights(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full((4096,), value) for name in NAMES}


# --- the vote -----------------------------------------------------------------------------


def test_an_engine_holding_the_version_takes_no_part_and_blocks_nothing() -> None:
    vote = FleetVote(["a", "b"], Policy.ALL)
    vote.hold("a")
    assert (vote.live, vote.verdict()) == (["b"], Verdict.PENDING)
    vote.prepare("b")
    assert vote.verdict() is Verdict.COMMIT


def test_a_vote_of_engines_all_holding_the_version_commits_nothing_and_is_done() -> None:
    vote = FleetVote(["a", "b"], Policy.ALL)
    vote.hold("a")
    vote.hold("b")
    assert (vote.live, vote.hopeless, vote.verdict()) == ([], False, Verdict.COMMIT)


@pytest.mark.parametrize(
    ("policy", "verdict"), [(Policy.ALL, Verdict.ABORT), (Policy.AVAILABLE, Verdict.COMMIT)]
)
def test_beside_an_engine_holding_the_version_a_failure_counts_as_before(
    policy: Policy, verdict: Verdict
) -> None:
    vote = FleetVote(["a", "b"], policy)
    vote.hold("a")
    vote.fail("b", AiosyncError("refused"))
    assert vote.verdict() is verdict


# --- senders and receivers in this process ------------------------------------------------


async def test_a_retry_of_a_committed_version_is_reported_current_and_the_engine_stays() -> None:
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(ModuleSink(weights(0.0), staged=True)) as receiver,
            WeightSender(receiver.endpoint, config=SMALL) as sender,
        ):
            await sender.send(weights(1.0), version=5)
            retry = await sender.send(weights(1.0), version=5)
            assert (retry.version, retry.buckets, retry.bytes) == (5, 0, 0)
            assert (retry.current, retry.committed, retry.failed) == ([receiver.endpoint], [], [])
            assert sender.engines == [receiver.endpoint]
            assert (await sender.send(weights(2.0), version=6)).committed == [receiver.endpoint]
            assert receiver.current_version == 6
            assert receiver.failures == []  # the retry never reached the engine


async def test_an_older_version_is_refused_and_the_engine_stays_in_the_fleet() -> None:
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(ModuleSink(weights(0.0), staged=True)) as receiver,
            WeightSender(receiver.endpoint, config=SMALL) as sender,
        ):
            await sender.send(weights(1.0), version=5)
            with pytest.raises(RejectedError, match="not newer than the engine's 5") as info:
                await sender.send(weights(1.0), version=4)
            assert info.value.peer == receiver.endpoint
            assert sender.engines == [receiver.endpoint]
            assert sender.lost_engines == {}
            assert (await sender.send(weights(2.0))).version == 6


async def test_a_fleet_retry_goes_only_to_the_engines_behind() -> None:
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(ModuleSink(weights(0.0), staged=True)) as ahead,
            WeightReceiver(ModuleSink(weights(0.0), staged=True)) as behind,
            WeightSender(ahead.endpoint, config=SMALL) as sender,
        ):
            await sender.send(weights(1.0), version=3)
            await sender.add_engine(behind.endpoint)  # a fresh engine joins: version None
            report = await sender.send(weights(1.0), version=3)  # policy all
            assert report.current == [ahead.endpoint]
            assert report.committed == [behind.endpoint]
            assert (ahead.current_version, behind.current_version) == (3, 3)
            assert sender.remote_versions == {ahead.endpoint: 3, behind.endpoint: 3}


class HeldCommitSink(ModuleSink):
    """A staged sink whose commit (in a worker thread) waits until ``release`` is set."""

    def __init__(self, model: dict[str, torch.Tensor]) -> None:
        super().__init__(model, staged=True)
        self.entered = threading.Event()
        self.release = threading.Event()

    def commit(self, version: int) -> None:
        self.entered.set()
        self.release.wait(GUARD)
        super().commit(version)


async def test_a_retry_after_a_cancelled_send_finds_the_version_held() -> None:
    """The caller's own timeout cancels a send whose commit is under way: the engine
    commits it anyway; the retry learns that from the commit's late answer."""
    sink = HeldCommitSink(weights(0.0))
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(sink) as receiver,
            WeightSender(receiver.endpoint, config=SMALL) as sender,
        ):
            sink.release.set()
            await sender.send(weights(1.0), version=0)
            sink.release.clear()
            sink.entered.clear()
            async with anyio.create_task_group() as tg:

                async def cancel_once_committing() -> None:
                    await anyio.to_thread.run_sync(sink.entered.wait, GUARD)
                    tg.cancel_scope.cancel()  # the caller gives up on the send

                tg.start_soon(cancel_once_committing)
                await sender.send(weights(2.0), version=1)
            assert sender.remote_versions == {receiver.endpoint: 0}  # as far as it knows
            sink.release.set()
            assert await receiver.wait_for_version(1, GUARD) == 1
            retry = await sender.send(weights(2.0), version=1)
            assert retry.current == [receiver.endpoint]
            assert sender.remote_versions == {receiver.endpoint: 1}
            assert (await sender.send(weights(3.0))).committed == [receiver.endpoint]
            assert receiver.current_version == 2


class SlowSink(ModuleSink):
    """A sink that takes ``delay`` seconds on each bucket (a stuck engine)."""

    def __init__(self, model: dict[str, torch.Tensor], delay: float) -> None:
        super().__init__(model, staged=True)
        self.delay = delay
        self.gate = threading.Event()

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.gate.wait(self.delay)
        super().apply_bucket(bucket, specs)


async def test_an_engine_that_leaves_the_fleet_is_named_in_the_error_that_removes_it() -> None:
    sink = SlowSink(weights(0.0), delay=GUARD)
    quick = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=0.5)
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(sink, config=ReceiverConfig(swap_timeout=0.2)) as receiver,
            WeightSender(receiver.endpoint, config=quick) as sender,
        ):
            with pytest.raises(SyncTimeoutError) as info:
                await sender.send(weights(1.0), version=0)
            assert f"{receiver.endpoint} leaves the fleet" in str(info.value)
            assert sender.engines == []
            assert receiver.endpoint in sender.lost_engines
            with pytest.raises(PeerGoneError, match="no engines to send to") as gone:
                await sender.send(weights(1.0), version=0)
            assert receiver.endpoint in str(gone.value)
            sink.gate.set()
