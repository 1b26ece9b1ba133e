"""A sender never reports a version failed on an engine that may still commit it.

Both sides state their bounds at the hello (the engine's ``swap_timeout`` and ``ack_at``,
the sender's timeout); a commit carries the sender's deadline on the wall clock, and an
engine past it makes nothing live. A sender that gives up with the commit sent reports the
engine *in doubt*, and the engine's next contact says which version it holds. Pure machine
tests first, then receivers in this process, then an engine process stopped (SIGSTOP)
before each message of a version.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time

import anyio
import pytest
import torch

from aiosync import (
    ModuleSink,
    Policy,
    ReceiverConfig,
    RejectedError,
    SenderConfig,
    SyncTimeoutError,
    WeightReceiver,
    WeightSender,
)
from aiosync.core.engine_actions import Action, CommitSink, Discard, Peer
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import InDoubtError
from aiosync.core.hello import stated_timeout, uncovered
from aiosync.core.ready_terms import ReadyTerms
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import PROTOCOL_MAX, Ack, Commit, Complete, Hello, Message, Ready
from aiosync.pipeline.links import COMMIT_GRACE
from tests.helpers.peer_processes import first, process
from tests.unit.test_engine_session import (
    PEER,
    SESSION,
    ack_of,
    hello,
    machine,
    reply,
    send,
    stream,
)

GUARD = 60  # seconds: a hang guard only, never a measured bound
NAMES = [f"layer.{i}" for i in range(6)]


def weights(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full((4096,), value) for name in NAMES}


# --- the engine's machine ---------------------------------------------------------------


def prepared(now: list[float], *, staged: bool = True) -> EngineSession:
    """An engine session (wall clock ``now[0]``) with version 1 streamed and prepared."""
    engine = machine(staged=staged)
    engine.clock = lambda: now[0]
    send(engine, hello())
    stream(engine, 1)
    ack = ack_of(send(engine, Complete(1, 3, 2, 2)))
    assert ack.ok, ack
    return engine


def test_a_commit_past_its_deadline_is_refused_and_nothing_goes_live() -> None:
    now = [1000.0]
    engine = prepared(now)
    now[0] = 1005.0  # the engine was stopped, say, and resumed after the sender gave up
    actions = send(engine, Commit(1, 4, deadline=1004.0))
    ack = ack_of(actions)
    assert (ack.ok, ack.seq) == (False, 4)
    assert "past the sender's deadline" in (ack.error or "")
    assert not any(isinstance(a, CommitSink) for a in actions)
    assert Discard(1) in actions
    assert engine.current_version is None
    assert "past the sender's deadline" in engine.failures[-1].reason


def test_a_commit_in_time_takes_its_deadline_to_the_swap() -> None:
    now = [1000.0]
    engine = prepared(now)
    actions = engine.receive(PEER, Commit(1, 4, deadline=1004.0), 0.0)
    assert actions == [CommitSink(PEER, 1, 1004.0)]


def test_a_commit_without_a_deadline_is_taken_as_before() -> None:
    now = [1e12]
    engine = prepared(now)
    actions = engine.receive(PEER, Commit(1, 4), 0.0)
    assert actions == [CommitSink(PEER, 1, None)]


@pytest.mark.parametrize("staged", [True, False])
def test_the_ready_states_the_engines_wait_and_when_it_acks(staged: bool) -> None:
    engine = machine(staged=staged)
    engine.terms = ReadyTerms(30.0, "live")
    ready = reply(send(engine, hello()))
    assert ready == Ready(
        SESSION,
        PROTOCOL_MAX,
        None,
        swap_timeout=30.0 if staged else None,  # in place: never a lease to wait for
        ack_at="live",
    )


@pytest.mark.parametrize(
    ("said", "kept"), [(10.0, 10.0), (None, None), (-1.0, None), (math.inf, None), (math.nan, None)]
)
def test_the_senders_stated_timeout_is_kept_only_when_plain(
    said: float | None, kept: float | None
) -> None:
    engine = machine()
    message = Hello(2, PROTOCOL_MAX, SESSION, "trainer", hello().plane, timeout=said)
    send(engine, message)
    assert engine.sessions[PEER].timeout == kept
    assert stated_timeout(said) == kept


def test_a_sender_that_cannot_cover_the_engines_wait_is_told_both_values() -> None:
    live = Ready(SESSION, PROTOCOL_MAX, None, swap_timeout=30.0, ack_at="live")
    problem = uncovered(10.0, live)
    assert problem is not None
    assert "timeout (10s)" in problem
    assert "swap_timeout (30s" in problem
    assert uncovered(30.0, live) is not None  # not above it
    assert uncovered(31.0, live) is None
    staged = Ready(SESSION, PROTOCOL_MAX, None, swap_timeout=30.0, ack_at="staged")
    assert uncovered(10.0, staged) is None  # the ack goes before any wait
    assert uncovered(10.0, Ready(SESSION, PROTOCOL_MAX, None)) is None  # states no wait


# --- the sender's machine ---------------------------------------------------------------


def opened(remote: int | None = 0) -> LinkSession:
    link = LinkSession("engine-0", SESSION)
    link.ready(Ready(SESSION, PROTOCOL_MAX, remote))
    return link


def test_a_commit_left_unanswered_is_in_doubt_until_its_answer_comes() -> None:
    link = opened()
    link.begin(1)
    for seq in (0, 1, 2):
        link.sent(seq)
    assert not link.commit_pending
    link.sent_commit(3)
    assert link.commit_pending
    link.ack(Ack(1, 0, True))
    link.failed()  # the sender gave up (a user's cancellation, say)
    assert (link.doubt, link.remote_version) == ((1, 3), 0)
    for seq in (1, 2):
        assert link.ack(Ack(1, seq, True)) is None  # leftovers
    assert link.doubt == (1, 3)
    assert link.ack(Ack(1, 3, True)) is None  # the commit's answer: it committed
    assert (link.doubt, link.remote_version) == (None, 1)


def test_a_commit_in_doubt_refused_leaves_the_version_where_it_was() -> None:
    link = opened()
    link.begin(1)
    link.sent(0)
    link.sent_commit(1)
    link.failed()
    link.ack(Ack(1, 0, True))
    link.ack(Ack(1, 1, False, error="past the sender's deadline"))
    assert (link.doubt, link.remote_version) == (None, 0)


def test_a_failure_before_the_commit_leaves_nothing_in_doubt() -> None:
    link = opened()
    link.begin(1)
    link.sent(0)
    link.failed()
    assert link.doubt is None


# --- receivers in this process ------------------------------------------------------------


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


async def test_a_silent_engine_with_the_commit_sent_is_in_doubt_and_its_version_shows_again() -> (
    None
):
    """The engine took the commit in time, then went quiet: the sender says in doubt."""
    sink = HeldCommitSink(weights(0.0))
    config = ReceiverConfig(swap_timeout=0.5)
    quick = SenderConfig(buffer_bytes=64 * 1024, timeout=0.5)
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(sink, config=config) as receiver,
            WeightSender(receiver.endpoint, config=quick) as sender,
        ):
            sink.release.set()
            await sender.send(weights(1.0), version=0)
            sink.release.clear()
            with pytest.raises(InDoubtError) as info:
                await sender.send(weights(2.0), version=1)
            assert sink.entered.is_set()  # it took the commit before the deadline
            message = str(info.value)
            assert "may have committed version 1" in message
            assert "leaves the fleet" in message
            assert info.value.peer == receiver.endpoint
            assert sender.engines == []
            assert isinstance(sender.lost_engines[receiver.endpoint], InDoubtError)
            sink.release.set()
            assert await receiver.wait_for_version(1, GUARD) == 1
            await sender.add_engine(receiver.endpoint)  # the next contact says
            assert sender.remote_versions == {receiver.endpoint: 1}


async def test_under_available_an_engine_in_doubt_is_in_the_report() -> None:
    held = HeldCommitSink(weights(0.0))
    plain = ModuleSink(weights(0.0), staged=True)
    config = ReceiverConfig(swap_timeout=0.5)
    quick = SenderConfig(buffer_bytes=64 * 1024, timeout=0.5, policy=Policy.AVAILABLE)
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(held, config=config) as slow,
            WeightReceiver(plain, config=config) as fast,
            WeightSender([slow.endpoint, fast.endpoint], config=quick) as sender,
        ):
            report = await sender.send(weights(1.0), version=0)
            assert report.committed == [fast.endpoint]
            assert report.in_doubt == [slow.endpoint]
            [doubt] = report.failed
            assert (doubt.engine, doubt.status) == (slow.endpoint, "in doubt")
            assert "may have committed version 0" in (doubt.error or "")
            held.release.set()
            assert await slow.wait_for_version(0, GUARD) == 0


async def test_leases_held_past_the_senders_deadline_refuse_the_commit_naming_both_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not a sender's timeout and a later commit: the engine refuses at the deadline."""
    timeout = 4.0
    config = ReceiverConfig(swap_timeout=30.0)
    small = SenderConfig(buffer_bytes=64 * 1024, timeout=timeout)
    sink = ModuleSink(weights(0.0), staged=True)
    with anyio.fail_after(GUARD):
        async with WeightReceiver(sink, config=config) as receiver:
            with caplog.at_level(logging.WARNING, logger="aiosync.pipeline.links"):
                async with WeightSender(receiver.endpoint, config=small) as sender:
                    await sender.send(weights(1.0), version=0)
                    leased, done = anyio.Event(), anyio.Event()

                    async def request() -> None:
                        async with receiver.serving() as version:
                            assert version == 0
                            leased.set()
                            await done.wait()

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(request)
                        await leased.wait()
                        with pytest.raises(RejectedError) as info:
                            await sender.send(weights(2.0), version=1)
                        done.set()
                    assert not isinstance(info.value, SyncTimeoutError)
                    reason = info.value.reason
                    assert "sender's deadline came first" in reason
                    assert "it waits 4s" in reason
                    assert "swap_timeout of 30s" in reason
                    assert receiver.current_version == 0  # and it stays there
                    assert sender.engines == [receiver.endpoint]  # a refusal: still here
                    assert (await sender.send(weights(3.0), version=2)).committed
            warned = " ".join(r.getMessage() for r in caplog.records)
            assert "timeout (4s)" in warned
            assert "swap_timeout (30s" in warned
            assert receiver.current_version == 2


async def test_a_commit_carries_the_senders_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is the sender's own wait from the commit on, less the grace."""
    seen: list[Commit] = []
    receive = EngineSession.receive

    def spying(self: EngineSession, peer: Peer, message: Message, now: float) -> list[Action]:
        if isinstance(message, Commit):
            seen.append(message)
        return receive(self, peer, message, now)

    monkeypatch.setattr(EngineSession, "receive", spying)
    timeout = 20.0
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=timeout)
    sink = ModuleSink(weights(0.0), staged=True)
    with anyio.fail_after(GUARD):
        async with (
            WeightReceiver(sink) as receiver,
            WeightSender(receiver.endpoint, config=config) as sender,
        ):
            before = time.time()
            await sender.send(weights(1.0), version=0)
            after = time.time()
    [commit] = seen
    assert commit.deadline is not None
    grace = min(COMMIT_GRACE, timeout / 4)
    assert before + timeout - grace <= commit.deadline <= after + timeout - grace


# --- an engine process stopped before each message ----------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP/SIGCONT of a child process")
async def test_an_engine_stopped_before_each_message_never_commits_after_the_sender_gave_up() -> (
    None
):
    """Version v stops the engine before its v-th message (begin, 3 buckets, complete,
    commit); the sender gives up; after SIGCONT the engine must not make v live. Where the
    commit had gone out, the sender says in doubt; the next session shows the version."""
    config = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=1.0)
    messages = 6
    with process("tests.helpers.stopping_engine") as proc:
        ready = await anyio.to_thread.run_sync(first, proc, "ready")
        endpoint = str(ready["endpoint"])
        model = {f"w{i}": torch.full((4096,), float(i)) for i in range(12)}  # 3 buckets
        with anyio.fail_after(GUARD * 3):
            async with WeightSender(endpoint, config=config) as sender:
                report = await sender.send(model, version=0)
                assert report.buckets == 3
                for version in range(1, messages + 1):
                    with pytest.raises(SyncTimeoutError) as info:
                        await sender.send(model, version=version)
                    stop = await anyio.to_thread.run_sync(first, proc, "stopping")
                    assert (stop["version"], stop["message"]) == (version, version)
                    if version >= messages - 1:  # complete and commit went out together
                        assert isinstance(info.value, InDoubtError), info.value
                    os.kill(proc.pid, signal.SIGCONT)
                    outcome = await anyio.to_thread.run_sync(first, proc, "outcome")
                    assert outcome == {"event": "outcome", "version": version, "live": False}
                    await sender.add_engine(endpoint)
                    assert sender.remote_versions == {endpoint: 0}
