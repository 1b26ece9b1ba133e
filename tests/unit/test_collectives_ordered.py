"""Collectives queued without a host wait are watched: CompletionWatch on stand-in events.

The watch only asks an event ``query()`` and a work ``exception()``, so these tests use
stand-ins (no GPU): a step not done by its deadline breaks and aborts the group without
anyone waiting on it; ``settle`` returns once every step is done and raises when one
failed, timed out, or completed only because the group was aborted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from aiosync.collectives.executor import Deadline, GroupExecutor
from aiosync.collectives.ordered import CompletionWatch
from aiosync.core.errors import PeerGoneError, SyncTimeoutError


class FakeEvent:
    """Stands in for a CUDA event: done once ``finish()`` was called."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def finish(self) -> None:
        self.done.set()


class FakeWork:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def exception(self) -> Exception | None:
        return self.error


@contextmanager
def watched() -> Iterator[tuple[GroupExecutor, CompletionWatch]]:
    executor = GroupExecutor("watch-test", join_timeout=5)
    executor.start()
    watch = CompletionWatch(executor, peers=("engine-a",))
    try:
        yield executor, watch
    finally:
        watch.close()
        executor.close()


def add(watch: CompletionWatch, event: FakeEvent, seconds: float, works: Any = ()) -> None:
    watch.add(event, Deadline.after(seconds), "broadcast from buffer 0", works)  # type: ignore[arg-type]


def wait_until(check: Any, seconds: float = 30) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "condition never held"
        time.sleep(0.01)


def test_a_step_late_for_its_deadline_breaks_the_group_with_no_one_waiting() -> None:
    with watched() as (executor, watch):
        done, stuck = FakeEvent(), FakeEvent()
        add(watch, done, 0.2)
        add(watch, stuck, 0.3)
        done.finish()
        assert watch.pending
        wait_until(lambda: executor.broken is not None)
        assert isinstance(executor.broken, SyncTimeoutError)
        assert "did not finish within the 0.3s deadline" in str(executor.broken)
        assert "engine-a" in str(executor.broken)
        with pytest.raises(SyncTimeoutError):  # later work fails at once
            executor.submit(lambda: None)


def test_settle_returns_once_every_step_is_done() -> None:
    with watched() as (executor, watch):
        events = [FakeEvent() for _ in range(3)]
        for event in events:
            add(watch, event, 30)
        timer = threading.Timer(0.05, lambda: [e.finish() for e in events])
        timer.start()
        watch.settle(Deadline.after(30))
        timer.join()
        assert not watch.pending
        assert executor.broken is None


def test_settle_past_its_deadline_breaks_the_group() -> None:
    with watched() as (executor, watch):
        add(watch, FakeEvent(), 30)
        with pytest.raises(SyncTimeoutError, match=r"0\.1s deadline"):
            watch.settle(Deadline.after(0.1))
        assert executor.broken is not None


def test_a_step_that_completed_with_an_error_fails_settle() -> None:
    with watched() as (executor, watch):
        event = FakeEvent()
        add(watch, event, 30, [FakeWork(), FakeWork(RuntimeError("NCCL error: remote closed"))])
        event.finish()
        with pytest.raises(PeerGoneError, match="remote closed"):
            watch.settle(Deadline.after(5))
        assert executor.broken is not None  # the group is out of step: broken


def test_a_step_completed_by_an_abort_still_fails_settle() -> None:
    with watched() as (executor, watch):
        event = FakeEvent()
        add(watch, event, 30)
        executor.fail(SyncTimeoutError("group closed with a receive queued"))
        event.finish()  # an aborted communicator ends its kernels: the event completes
        with pytest.raises(SyncTimeoutError, match="receive queued"):
            watch.settle(Deadline.after(5))


def test_close_stops_the_watching_thread() -> None:
    executor = GroupExecutor("watch-close", join_timeout=5)
    executor.start()
    watch = CompletionWatch(executor)
    add(watch, FakeEvent(), 60)
    watch.close()
    watch.close()  # idempotent
    assert not any(t.name == "aiosync-watch-watch-close" for t in threading.enumerate())
    executor.close()


def test_close_returns_while_the_watcher_is_stuck_aborting_a_late_group() -> None:
    """An abort that blocks (NCCL's can) holds the watching thread: close still returns."""
    executor = GroupExecutor("watch-stuck", join_timeout=0.2)
    executor.start()
    entered, release = threading.Event(), threading.Event()

    def stuck_abort() -> None:
        entered.set()
        release.wait(60)

    executor._abort_group = stuck_abort  # type: ignore[method-assign]
    watch = CompletionWatch(executor)
    try:
        add(watch, FakeEvent(), 0.01)
        assert entered.wait(30), "the late step never broke the group"
        closed = threading.Event()

        def close() -> None:
            watch.close()
            closed.set()

        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        assert closed.wait(10), "close waited for the stuck abort"
    finally:
        release.set()
        watch.close()
        executor.close()
