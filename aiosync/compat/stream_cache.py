"""Senders kept across calls of the blocking drop-in, one per caller's socket.

NeMo-RL calls ``stream_weights_via_ipc_zmq_impl`` once per training step with the same
socket and buffer size. Making a sender each time costs new buffers, new IPC handles and a
new engine session (on a GPU about 60 ms of every call). A :class:`CachedStream` keeps one
:class:`~aiosync.WeightSender` alive, with its buffers and session, on a private event loop
in a daemon thread, and serves each call there.

A cached stream belongs to one socket object, one device and one buffer size; a call with
another size or device, the socket's closing (seen at the next call, or within
``IDLE_CHECK`` seconds), or :func:`release_streams` releases it (goodbye to the engine
unless the socket is closed, buffers freed). The cache holds the socket object, so it is
never collected, and closed, under the cached sender: close it yourself when done.
An engine drops a session it has not heard from for its ``session_timeout``; a REQ socket
cannot send keepalives, so the drop-in replaces a cached stream whose session is gone by a
fresh one, once, if the failed call had not read any tensor yet.

The caller's socket may be connected to the engine's address or bound for the engine to
connect to (NeMo-RL's policy worker binds its REQ socket; the engine is then a
``WeightReceiver(sink, connect=address)``): either way it is used as it is. Before a fresh
sender's hello, an ``ipc://`` path that two live sockets bound (the caller's bind took it
over from an engine bound there, say) is refused at once, naming it
(:func:`~aiosync.channels.unix_listeners.refuse_double_bind`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

import anyio
import torch
import zmq

from aiosync.channels.unix_listeners import refuse_double_bind
from aiosync.core.errors import PeerGoneError, SyncTimeoutError
from aiosync.pipeline.report import ProgressCallback, SyncReport
from aiosync.runtime import run, unwrap_group
from aiosync.trainer.sender import SenderConfig, WeightSender

log = logging.getLogger(__name__)

_Job = tuple[Iterable[Any], Any, Any, concurrent.futures.Future[Any]]
"""One call: the pairs, the caller's CUDA stream, a progress callback, the result."""

IDLE_CHECK = 5.0  # seconds between checks of an idle cached stream's owner loop
START_TIMEOUT = 120.0  # seconds to open the sender (buffers, IPC handles, handshake)
RELEASE_TIMEOUT = 30.0  # seconds to say goodbye and free the buffers


class CachedStream:
    """One sender on one caller's socket, kept open on a private loop between calls."""

    def __init__(
        self, socket: zmq.Socket[bytes], device: torch.device, config: SenderConfig
    ) -> None:
        self.socket = socket  # held, so the socket is never collected (and closed) under us
        self.device = device
        self.config = config
        self._jobs: asyncio.Queue[_Job | None]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opened: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="aiosync-dropin", daemon=True)
        self._thread.start()
        self._opened.result(START_TIMEOUT)

    def fits(self, socket: zmq.Socket[bytes], device: torch.device, config: SenderConfig) -> bool:
        """Whether this stream serves a call with these arguments as it is."""
        return (
            self.socket is socket
            and not socket.closed
            and self.device == device
            and self.config == config
            and self._thread.is_alive()
        )

    def send(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        timeout: float,
        progress: ProgressCallback | None = None,
    ) -> SyncReport:
        """Stream one version through the cached sender; blocks until it committed.

        The caller's current CUDA stream (where its weights were produced) is the one the
        packing runs on.
        """
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        done: concurrent.futures.Future[SyncReport] = concurrent.futures.Future()
        loop = self._loop
        if loop is None or loop.is_closed():
            raise PeerGoneError("the cached sender's loop has ended")
        loop.call_soon_threadsafe(self._jobs.put_nowait, (pairs, stream, progress, done))
        # The sender's own waits are bounded; this bound is only a backstop.
        concurrent.futures.wait([done], timeout * 4 + START_TIMEOUT)
        if not done.done():
            raise SyncTimeoutError(f"the cached sender did not answer within {timeout:g}s")
        return done.result()

    def release(self) -> None:
        """Say goodbye, free the buffers and end the loop thread (idempotent)."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(self._jobs.put_nowait, None)
        if self._thread is not threading.current_thread():
            self._thread.join(RELEASE_TIMEOUT)

    # --- the loop thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            run(self._owner)
        except BaseException as exc:  # reported to a caller still waiting to open
            if not self._opened.done():
                self._opened.set_exception(exc)
            else:
                log.warning("cached drop-in sender ended: %s", exc)

    async def _owner(self) -> None:
        from aiosync.channels.zmq import ZmqChannel

        self._loop = asyncio.get_running_loop()
        self._jobs = asyncio.Queue()
        channel = ZmqChannel.wrap(self.socket)
        async with WeightSender(channel, device=self.device, config=self.config) as sender:
            self._opened.set_result(None)
            while (job := await self._next_job()) is not None:
                pairs, stream, progress, done = job
                try:
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            report = await sender.send(pairs, progress=progress)
                    else:
                        report = await sender.send(pairs, progress=progress)
                except Exception as exc:
                    done.set_exception(exc)
                else:
                    done.set_result(report)
            if self.socket.closed:  # no goodbye through a closed socket
                for link in sender._links.values():
                    link.broken = PeerGoneError("the caller closed the socket")

    async def _next_job(
        self,
    ) -> _Job | None:
        """The next call to serve; None once released or once the caller's socket closed."""
        while True:
            with anyio.move_on_after(IDLE_CHECK):
                return await self._jobs.get()
            if self.socket.closed:
                return None


_streams: dict[int, CachedStream] = {}
_lock = threading.Lock()


def cached_stream(
    socket: zmq.Socket[bytes], device: torch.device, config: SenderConfig
) -> tuple[CachedStream, bool]:
    """The cached stream for ``socket`` (made if none fits); and whether it is new."""
    with _lock:
        stream = _streams.get(id(socket))
        if stream is not None and stream.fits(socket, device, config):
            return stream, False
        if stream is not None:
            del _streams[id(socket)]
    if stream is not None:
        stream.release()
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    refuse_double_bind(endpoint)
    try:
        fresh = CachedStream(socket, device, config)
    except Exception as exc:
        cause = unwrap_group(exc)
        if not isinstance(cause, SyncTimeoutError):  # a bound socket waits for an engine
            raise
        hint = _nobody_hint(endpoint)
        raise SyncTimeoutError(f"{cause.reason}; {hint}", peer=cause.peer) from exc
    with _lock:
        _streams[id(socket)] = fresh
    return fresh, True


def _nobody_hint(endpoint: str) -> str:
    """What a hello that found no engine at ``endpoint`` may mean, for bound and connected."""
    where = endpoint or "the socket's address"
    return (
        f"no engine reached this socket at {where}: if it is bound there, the engine must "
        f"connect to it (WeightReceiver(sink, connect={where!r}), or BackgroundReceiver(..., "
        "connect=...)); if it is connected, the engine must be bound there and alive"
    )


def release_streams(socket: zmq.Socket[bytes] | None = None) -> int:
    """Release the cached senders (of ``socket`` only, if given); returns how many."""
    with _lock:
        if socket is None:
            streams = list(_streams.values())
            _streams.clear()
        else:
            found = _streams.pop(id(socket), None)
            streams = [] if found is None else [found]
    for stream in streams:
        stream.release()
    return len(streams)
