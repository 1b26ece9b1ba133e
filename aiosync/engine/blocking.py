"""The engine's side for synchronous workers: a receiver in a background thread.

vLLM's worker extensions, and other engines whose workers are plain threads, have no event
loop to run a :class:`~aiosync.WeightReceiver` in. :class:`BackgroundReceiver` runs one in a
thread of its own, on its own loop, and offers blocking calls::

    with BackgroundReceiver(model) as receiver:      # or BackgroundReceiver(load_weights)
        tell_the_trainer(receiver.endpoint)
        receiver.wait_for_version(1, timeout=60)     # blocks; no async code here

A worker thread pins one version while it reads the weights with
``with receiver.serving() as version:`` (a staged sink is needed), the blocking twin of
:meth:`WeightReceiver.serving`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch

from aiosync.channels.base import Listener
from aiosync.channels.keys import ChannelAuth
from aiosync.core.engine_actions import SyncFailure
from aiosync.core.errors import AiosyncError, SyncTimeoutError, UsageError
from aiosync.engine.config import ReceiverConfig
from aiosync.engine.live_hook import OnLive
from aiosync.engine.receiver import WeightReceiver
from aiosync.engine.sinks import CallbackSink, ModuleSink, WeightSink
from aiosync.runtime import run, unwrap_group

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds to wait for the background receiver to serve
STOP_TIMEOUT = 30.0  # seconds to wait for its thread to end on exit

SinkOrModel = (
    WeightSink
    | torch.nn.Module
    | Mapping[str, torch.Tensor]
    | Callable[[Iterable[tuple[str, torch.Tensor]]], object]
)


def as_sink(target: SinkOrModel) -> WeightSink:
    """The sink that receives into ``target``.

    A module or a name -> tensor map goes in a :class:`ModuleSink`, a :class:`WeightSink` is
    used as is, a ``load_weights(pairs)`` callable goes in a :class:`CallbackSink`.
    """
    if isinstance(target, torch.nn.Module | Mapping):
        return ModuleSink(target)
    if all(hasattr(target, name) for name in ("apply_bucket", "commit", "abort", "expectations")):
        return target  # type: ignore[return-value]
    if callable(target):
        return CallbackSink(target)
    raise UsageError(
        "BackgroundReceiver takes an nn.Module, a name -> tensor map, a WeightSink or a "
        f"load_weights(pairs) callable, not {type(target).__name__}"
    )


class BackgroundReceiver:
    """A :class:`~aiosync.WeightReceiver` served from a background thread, for sync callers.

    Use as a plain ``with`` block: entering starts a thread (named ``aiosync-receiver``) with
    its own event loop (uvloop when installed) and returns once the receiver is serving, or
    raises the error that kept it from starting (a refused endpoint, say) or, after
    ``start_timeout`` seconds, an :class:`~aiosync.AiosyncError` naming the endpoint. Leaving
    the block stops the loop and joins the thread (within ``stop_timeout``), releasing its
    sockets and buffers. The thread installs no signal handlers.

    ``sink_or_model`` is an ``nn.Module`` or a name -> tensor map (wrapped in a
    :class:`~aiosync.ModuleSink`), a :class:`~aiosync.WeightSink` (used as is), or a
    ``load_weights(pairs)`` callable (wrapped in a :class:`~aiosync.CallbackSink`; it runs in
    a worker thread of the receiver). ``endpoint``, ``config``, ``auth``, ``on_commit`` and
    ``on_live`` are :class:`~aiosync.WeightReceiver`'s: ``on_live(version)`` runs as each
    version goes live, before any :meth:`serving` block on it is entered (a function in a
    worker thread of the receiver, an ``async def`` on its background loop).

    ``connect`` is :class:`~aiosync.WeightReceiver`'s too: the receiver connects to a
    trainer's bound address (NeMo-RL's policy worker binds its REQ socket) instead of binding.

    An error that ends the background loop is raised in the caller: by the next call to
    :meth:`wait_for_version` or :meth:`check`, or else on leaving the block.

    Thread safety: :attr:`current_version`, :attr:`servable` and :attr:`failures` are plain
    attribute reads of state the receiver's loop writes; each read is atomic, but two reads
    are not a snapshot (a version may commit between them), and with an in-place sink the
    weights may change while the caller reads them: :meth:`serving` pins one version.
    """

    def __init__(
        self,
        sink_or_model: SinkOrModel,
        endpoint: str | Listener | None = None,
        *,
        config: ReceiverConfig | None = None,
        auth: ChannelAuth | None = None,
        connect: str | None = None,
        on_commit: Callable[[int], object] | None = None,
        start_timeout: float = START_TIMEOUT,
        stop_timeout: float = STOP_TIMEOUT,
        on_live: OnLive | None = None,
    ) -> None:
        self.sink = as_sink(sink_or_model)
        self._requested = endpoint
        self._connect = connect
        self._config = config
        self._auth = auth
        self._on_commit = on_commit
        self._on_live = on_live
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._receiver: WeightReceiver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._raised = False
        self._stopping = False

    # --- what a worker reads ------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The address senders connect to."""
        if self._receiver is None:
            raise UsageError("background receiver is not running; use 'with BackgroundReceiver'")
        return self._receiver.endpoint

    @property
    def current_version(self) -> int | None:
        """The last committed version (None before the first); a plain read, see the class."""
        return self._receiver.current_version if self._receiver else None

    @property
    def servable(self) -> bool:
        """False mid-version in place, or after the live version's ``on_live`` hook failed."""
        return self._receiver.servable if self._receiver else True

    @property
    def failures(self) -> list[SyncFailure]:
        """The streams that did not commit, oldest first."""
        return self._receiver.failures if self._receiver else []

    @property
    def running(self) -> bool:
        """True while the background thread serves."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def check(self) -> None:
        """Raise the error that ended the background loop, if one did (once)."""
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def wait_for_version(self, version: int, timeout: float) -> int:
        """Block until ``current_version >= version`` and return it.

        Raises :class:`~aiosync.SyncTimeoutError` after ``timeout`` seconds, and the
        background loop's error if it ends meanwhile.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                self.check()
                if self._error is not None or not self.running:
                    raise UsageError("background receiver is not running")
                current = self.current_version
                if current is not None and current >= version:
                    return current
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        raise SyncTimeoutError(
            f"receiver at {self.endpoint} still at version {self.current_version} "
            f"after {timeout:g}s",
            version=version,
        )

    @contextmanager
    def serving(self, timeout: float | None = None) -> Iterator[int | None]:
        """The blocking twin of :meth:`WeightReceiver.serving` for worker threads.

        Pins the weights for the block and yields exactly their version; a new version goes
        live between such blocks. Needs a staged sink. The lease is held on the background
        loop, so the calling thread may block in it (say, for a forward pass).
        """
        receiver, loop = self._receiver, self._loop
        if receiver is None or loop is None or not self.running:
            self.check()
            raise UsageError("background receiver is not running")
        granted: Future[tuple[int | None, asyncio.Event]] = Future()

        async def hold() -> None:
            release = asyncio.Event()
            async with receiver.serving(timeout) as version:
                granted.set_result((version, release))
                await release.wait()

        held = asyncio.run_coroutine_threadsafe(hold(), loop)
        pending: list[Future[Any]] = [granted, held]
        wait(pending, return_when=FIRST_COMPLETED)
        if not granted.done():
            held.result()  # raises why the lease was not granted
        version, release = granted.result()
        try:
            yield version
        finally:
            loop.call_soon_threadsafe(release.set)
            held.result(self._stop_timeout)

    # --- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> BackgroundReceiver:
        if self._thread is not None:
            raise UsageError("a BackgroundReceiver can be entered once")
        self._thread = threading.Thread(target=self._main, name="aiosync-receiver")
        self._thread.start()
        started = self._ready.wait(self._start_timeout)
        if self._error is not None or not started:
            try:
                self._shutdown()
            finally:
                self.check()
            raise AiosyncError(
                f"weight receiver at {self._where()} did not start serving within "
                f"{self._start_timeout:g}s"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._shutdown()
        if exc is None:
            self.check()
        elif self._error is not None and not self._raised and exc is not self._error:
            self._raised = True  # the block's own error goes on, carrying this one
            exc.add_note(f"the background weight receiver also failed: {self._error!r}")

    def _shutdown(self) -> None:
        """Stop the loop and join the thread (bounded)."""
        self._stopping = True  # read by a loop that starts only now
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(self._stop_timeout)
            if thread.is_alive():
                raise AiosyncError(
                    f"weight receiver at {self._where()} did not stop within "
                    f"{self._stop_timeout:g}s (its thread is still running)"
                )

    def _where(self) -> str:
        try:
            return self.endpoint
        except AiosyncError:
            requested = self._connect if self._connect is not None else self._requested
            return repr(requested) if requested is not None else "a private ipc://"

    # --- the background thread -----------------------------------------------------------

    def _main(self) -> None:
        try:
            run(self._serve)
        except BaseException as exc:
            cause = unwrap_group(exc)
            if not isinstance(cause, AiosyncError):
                error = AiosyncError(f"weight receiver at {self._where()} failed: {cause!r}")
                error.__cause__ = cause
                cause = error
            log.error("background weight receiver stopped: %s", cause)
            self._error = cause
        finally:
            self._join_workers()
            self._ready.set()
            self._notify()

    def _join_workers(self) -> None:
        """Wait (bounded) for the loop's worker threads, told to stop as the loop ended.

        anyio's worker threads are not daemons and outlive their loop by a moment; joining
        them here means no thread of this receiver is left once :meth:`__exit__` returns.
        """
        deadline = time.monotonic() + self._stop_timeout
        for thread in threading.enumerate():
            if self._loop is not None and getattr(thread, "loop", None) is self._loop:
                thread.join(max(0.0, deadline - time.monotonic()))

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        receiver = WeightReceiver(
            self.sink,
            self._requested,
            config=self._config,
            auth=self._auth,
            connect=self._connect,
            on_commit=self._committed,
            on_live=self._on_live,
        )
        async with receiver:
            self._receiver = receiver
            self._ready.set()
            if not self._stopping:
                await self._stop.wait()

    def _committed(self, version: int) -> None:
        """Wake blocked waiters, then run the caller's hook (a worker thread)."""
        self._notify()
        if self._on_commit is not None:
            self._on_commit(version)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<BackgroundReceiver {state} at {self._where()} version {self.current_version}>"
