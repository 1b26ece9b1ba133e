"""GroupExecutor.call_here: a job run on the calling thread, in the group's order."""

from __future__ import annotations

import threading

import pytest

from aiosync.collectives import Deadline, GroupExecutor
from aiosync.core.errors import PeerGoneError, SyncTimeoutError, UsageError


def test_an_idle_group_runs_the_job_on_the_calling_thread() -> None:
    with GroupExecutor("here") as executor:
        me = threading.get_ident()
        assert executor.call_here(threading.get_ident, deadline=Deadline.after(30)) == me


def test_jobs_submitted_first_run_first_on_the_groups_thread() -> None:
    order: list[str] = []
    started, release = threading.Event(), threading.Event()

    def first() -> None:
        started.set()
        release.wait(30)
        order.append("first")

    with GroupExecutor("queued") as executor:
        executor.submit(first)
        queued = executor.submit(lambda: order.append("second"))
        assert started.wait(30)
        caller = threading.Thread(
            target=lambda: executor.call_here(
                lambda: order.append("third"), deadline=Deadline.after(30)
            )
        )
        caller.start()
        caller.join(0.2)
        assert order == []  # waits for the jobs ahead of it
        release.set()
        caller.join(30)
        assert queued.done()
    assert order == ["first", "second", "third"]


def test_a_job_that_raises_breaks_the_group() -> None:
    def boom() -> None:
        raise RuntimeError("Connection reset by peer")

    with GroupExecutor("here-fails") as executor:
        with pytest.raises(PeerGoneError, match="Connection reset") as caught:
            executor.call_here(boom, deadline=Deadline.after(30), peers=["engine-a"])
        assert executor.broken is caught.value
        assert caught.value.peer == "engine-a"
        with pytest.raises(PeerGoneError):
            executor.call_here(lambda: None, deadline=Deadline.after(30))


def test_a_group_busy_past_the_deadline_times_out_and_breaks() -> None:
    release = threading.Event()
    with GroupExecutor("here-late", join_timeout=30) as executor:
        try:
            executor.submit(lambda: release.wait(30))
            with pytest.raises(SyncTimeoutError, match="receive into buffer 0"):
                executor.call_here(
                    lambda: None, deadline=Deadline.after(0.2), what="receive into buffer 0"
                )
            assert executor.broken is not None
        finally:
            release.set()


def test_a_closed_group_refuses() -> None:
    executor = GroupExecutor("here-closed")
    executor.start()
    executor.close()
    with pytest.raises(UsageError):
        executor.call_here(lambda: None, deadline=Deadline.after(5))
