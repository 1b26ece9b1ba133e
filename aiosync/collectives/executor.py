"""A dedicated thread per process group that runs its blocking collectives, with a deadline.

A torch collective blocks the calling thread until every rank took part (Gloo), or until
the host waits for the GPU (NCCL). :class:`GroupExecutor` runs them, in submission order,
on one thread of its own, so the event loop keeps serving heartbeats and other engines, and
so that all of a group's collectives are issued from one thread in one order (what NCCL and
Gloo require of the ranks of a group).

One :class:`Deadline` bounds a whole sync. When a wait runs past it, the executor raises
:class:`~aiosync.core.errors.SyncTimeoutError` naming the engines that did not answer, and
the group is aborted: NCCL's communicator is aborted (its blocked kernels end), and a Gloo
collective ends on its own once the group's timeout passes (Gloo groups are created with a
timeout no longer than the deadline). The group is then *broken*: every later call fails
at once with the same error, and a new group (a new executor) is how to reconnect.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch.distributed as dist

from aiosync.collectives.deadline import Deadline as Deadline
from aiosync.collectives.process_group import abort_side_group, destroy_side_group
from aiosync.core.errors import AiosyncError, PeerGoneError, SyncTimeoutError, UsageError

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_PENDING = 4096
"""Most jobs queued on one executor (the pipeline queues at most one per buffer or tensor)."""


def _cause(exc: Exception) -> Exception | None:
    """What a mapped error is raised from: the original, unless it was aiosync's already."""
    return None if isinstance(exc, AiosyncError) else exc


def collective_error(exc: BaseException, what: str, peers: Sequence[str]) -> AiosyncError:
    """The aiosync error for a collective that raised ``exc`` (a timeout, a lost peer...)."""
    if isinstance(exc, AiosyncError):
        return exc
    who = ", ".join(peers) or None
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(f"{what} timed out: {text}", peer=who)
    return PeerGoneError(f"{what} failed: {text}", peer=who)


class GroupExecutor:
    """One thread that runs a process group's blocking work in order, under deadlines.

    ``name`` names the group in messages and the thread. ``group`` may be given now or set
    later (:attr:`group`) once a job made it in this thread. ``join_timeout`` bounds how
    long leaving waits for the thread (a Gloo collective ends within the group's timeout).
    Use as ``async with``; jobs still queued at exit are cancelled, and the group is
    destroyed (or aborted, if broken).
    """

    def __init__(
        self,
        name: str,
        *,
        group: dist.ProcessGroup | None = None,
        join_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.group = group
        self.join_timeout = join_timeout
        self.broken: AiosyncError | None = None
        self._jobs: queue.Queue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.Queue(MAX_PENDING)
        self._thread = threading.Thread(target=self._serve, name=f"aiosync-group-{name}")
        self._thread.daemon = True  # never held for by threading; see _join_at_exit
        self._started = False
        self._closed = False
        self._busy = False
        self._releasing = False  # the thread's job is the group's release (a clean close)
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # held while a job runs, here or in call_here
        self._pending = 0  # jobs queued or running on the thread (under _lock)

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (``async with`` and :meth:`__enter__` do this)."""
        if not self._started:
            self._started = True
            self._thread.start()
            _running.add(self)

    def close(self, *, wait: bool = True) -> None:
        """Stop the thread and release the group (idempotent).

        The group is destroyed in its own thread after the jobs queued before; a broken
        NCCL group is aborted first, so that a blocked collective returns. ``wait``: block
        until the thread ended (at most ``join_timeout``); without it, return at once (from
        an event loop) and let the thread end by itself (a blocked Gloo collective ends at
        its deadline).
        """
        if self._closed:
            return
        self._closed = True
        if not self._started:
            self._release_group()
            return
        if self.broken is not None:
            self._abort_group()  # NCCL: the blocked collective returns now
        self._put(self._release_group)  # Gloo: after the blocked collective timed out
        self._put(None)
        if not wait:
            return
        self._thread.join(self.join_timeout)
        if self._thread.is_alive():
            log.warning(
                "group %s: a collective is still blocked %.0fs after close; leaving its "
                "thread behind (it ends when the group's timeout passes)",
                self.name,
                self.join_timeout,
            )

    @property
    def alive(self) -> bool:
        """True while the thread runs (after close, False unless a collective still blocks)."""
        return self._thread.is_alive()

    async def __aenter__(self) -> GroupExecutor:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(asyncio.to_thread(self.close))

    def __enter__(self) -> GroupExecutor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- running work -----------------------------------------------------------------

    def submit(self, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``job`` on the thread and return its future at once (thread-safe).

        Raises the group's error at once if it is broken, :class:`UsageError` if the
        executor is not started or too many jobs are queued.
        """
        if self.broken is not None:
            raise self.broken
        if not self._started or self._closed or not self._thread.is_alive():
            raise UsageError(f"group {self.name}: executor not running")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            try:
                self._jobs.put_nowait((future, job))
            except queue.Full:
                raise UsageError(f"group {self.name}: {MAX_PENDING} collectives queued") from None
            self._pending += 1
        return future

    async def run(
        self,
        job: Callable[[], T],
        *,
        deadline: Deadline,
        what: str = "collective",
        peers: Sequence[str] = (),
    ) -> T:
        """Run ``job`` on the thread and await its result, at most until ``deadline``.

        Past the deadline the group is aborted and broken, and :class:`SyncTimeoutError`
        names ``peers`` (the engines that did not answer). A job that raised is mapped to
        an aiosync error (and breaks the group too: its ranks are out of step).
        """
        return await self.wait(self.submit(job), deadline=deadline, what=what, peers=peers)

    async def wait(
        self,
        future: concurrent.futures.Future[T],
        *,
        deadline: Deadline,
        what: str = "collective",
        peers: Sequence[str] = (),
    ) -> T:
        """Await a future from :meth:`submit` under ``deadline`` (see :meth:`run`)."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), deadline.remaining())
        except TimeoutError:
            raise self.fail(self._timeout(what, deadline, peers)) from None
        except Exception as exc:
            raise self._failed(exc, what, peers) from _cause(exc)

    def call(
        self,
        job: Callable[[], T],
        *,
        deadline: Deadline,
        what: str = "collective",
        peers: Sequence[str] = (),
    ) -> T:
        """The blocking twin of :meth:`run`, for worker threads (never the event loop)."""
        return self.result(self.submit(job), deadline=deadline, what=what, peers=peers)

    def call_here(
        self,
        job: Callable[[], T],
        *,
        deadline: Deadline,
        what: str = "collective",
        peers: Sequence[str] = (),
    ) -> T:
        """:meth:`call`, run on the calling thread when no job is queued or running.

        For work that only queues (an NCCL step ordered by CUDA events): the group's order
        holds (nothing else of it runs meanwhile; with jobs still queued, this is
        :meth:`call`), and the hand-over to the group's thread and back, on the critical
        path of a version's first bucket, is saved. Errors break the group as in :meth:`run`.
        """
        if not self._turn.acquire(timeout=deadline.remaining()):
            raise self.fail(self._timeout(what, deadline, peers))
        try:
            with self._lock:
                idle = self._pending == 0
            if idle and self._started and not self._closed and self._thread.is_alive():
                if self.broken is not None:
                    raise self.broken
                self._busy = True
                try:
                    return job()
                except Exception as exc:
                    raise self._failed(exc, what, peers) from _cause(exc)
                finally:
                    self._busy = False
        finally:
            self._turn.release()
        return self.call(job, deadline=deadline, what=what, peers=peers)

    def result(
        self,
        future: concurrent.futures.Future[T],
        *,
        deadline: Deadline,
        what: str = "collective",
        peers: Sequence[str] = (),
    ) -> T:
        """Block until ``future`` is done or ``deadline`` passes (see :meth:`run`)."""
        try:
            return future.result(deadline.remaining())
        except concurrent.futures.TimeoutError:
            raise self.fail(self._timeout(what, deadline, peers)) from None
        except Exception as exc:
            raise self._failed(exc, what, peers) from _cause(exc)

    def fail(self, error: AiosyncError) -> AiosyncError:
        """Break the group with ``error`` (the first error wins), abort it; return the error."""
        with self._lock:
            first = self.broken is None
            if first:
                self.broken = error
        if first:
            log.warning("group %s broken: %s", self.name, error)
            self._abort_group()
        return self.broken or error

    def _failed(self, exc: Exception, what: str, peers: Sequence[str]) -> AiosyncError:
        """A job raised ``exc``: the group breaks (its ranks are out of step)."""
        return self.fail(collective_error(exc, what, peers))

    def _timeout(self, what: str, deadline: Deadline, peers: Sequence[str]) -> SyncTimeoutError:
        who = ", ".join(peers) or None
        return SyncTimeoutError(
            f"{what} on group {self.name} did not finish within the {deadline.seconds:g}s "
            "deadline; the group was aborted (reconnect with a new group)",
            peer=who,
        )

    # --- the thread -------------------------------------------------------------------

    def _put(self, item: Callable[[], Any] | None) -> None:
        job: tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None = None
        if item is not None:
            job = (concurrent.futures.Future(), item)
        with self._lock:
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                log.warning("group %s: job queue full while closing", self.name)
                return
            self._pending += job is not None

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                break
            try:
                self._run_one(*item)
            finally:
                with self._lock:
                    self._pending -= 1
        self._drain()

    def _run_one(self, future: concurrent.futures.Future[Any], job: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        if self.broken is not None and job != self._release_group:
            future.set_exception(self.broken)
            return
        with self._turn:
            self._busy = True
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self._busy = False

    def _drain(self) -> None:
        """Cancel what is still queued (nothing will run it)."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _abort_group(self) -> None:
        group = self.group
        if group is not None:
            try:
                if abort_side_group(group):
                    self.group = None
            except Exception:
                log.exception("group %s: abort failed", self.name)

    def _release_group(self) -> None:
        self._releasing = True
        group, self.group = self.group, None
        if group is None:
            return
        try:
            destroy_side_group(group)
        except Exception as exc:
            log.info("group %s: destroy failed: %s", self.name, exc)
        else:
            log.debug("group %s released", self.name)


_running: weakref.WeakSet[GroupExecutor] = weakref.WeakSet()
EXIT_GRACE = 5.0
"""Seconds past a group's timeout that exit waits for its thread (torch's store client
retries a connection once more after its timeout)."""


@atexit.register
def _join_at_exit() -> None:
    """Let every group thread end before the interpreter does (bounded by its timeout).

    A thread left inside torch's C++ code (a store connect, a Gloo wait) when the process
    tears down ends it with ``terminate called``; every such wait has a deadline, so this
    waits at most each ``join_timeout`` plus :data:`EXIT_GRACE`. Groups still busy with a
    collective are broken first (a warning), so an NCCL collective returns at once; a
    thread only releasing its group after a clean close is just waited for.
    """
    for executor in list(_running):
        if executor.alive:
            if executor._busy and not executor._releasing:
                executor.fail(SyncTimeoutError(f"group {executor.name}: the process exits"))
            elif executor._busy:
                log.debug("group %s: its release is still running at exit", executor.name)
            executor.close(wait=False)
    for executor in list(_running):
        executor._thread.join(executor.join_timeout + EXIT_GRACE)
