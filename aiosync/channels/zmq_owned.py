"""The sockets and private context a ZMQ channel or listener made, closed once and never hung.

Dropping a channel or listener without ``aclose()`` must neither hang nor leak. pyzmq's own
clean-up can hang: a garbage-collected ``zmq.Context`` calls ``destroy()``, which closes the
sockets it knows through a *weak* set and then ``term()``s. When the sockets die with the
context in a reference cycle (an asyncio future's traceback is enough to make one), the
collector clears the weak references first, ``destroy()`` finds nothing to close, and
``term()`` waits for sockets that are still open: the next ``gc.collect()`` never returns.

So every channel and listener makes its sockets in a :class:`PrivateContext`, whose
collection never terminates anything, and hands them to an :class:`OwnedSockets`, which
holds them strongly and closes them itself: with the owner's linger from ``aclose()``, or,
through :func:`weakref.finalize` on the owner, with linger 0 once the owner is dropped.
The context is terminated only after every socket made in it is closed, so ``term()``
returns at once (or after the bounded linger of an ``aclose()``), whatever the order in
which the collector reaches the objects.

One context per owner, not one shared by all: ``aclose()`` keeps its bounded flush of a
last message (a goodbye, a final ack, :data:`~aiosync.channels.zmq_common.CLOSE_LINGER_MS`)
because ``term()`` waits for it; a shared context that is never terminated would let a
process that exits right after ``aclose()`` lose that message.

libzmq sockets are not thread-safe, and an asyncio event loop that watches a socket reads
it from its own thread. A socket dropped while the loop that last drove it still runs (the
blocking compat functions' background loop, say) is therefore closed on that loop, never
from the thread the collector happens to run in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger("aiosync.channels.zmq")


class PrivateContext(zmq.asyncio.Context):
    """A context of one channel or listener, closed only by its :class:`OwnedSockets`.

    pyzmq's ``__del__`` would ``destroy()`` it, which can wait forever (see the module's
    docstring); here collecting it does nothing, and its :class:`OwnedSockets` terminates it.
    """

    def __del__(self) -> None:
        return None


class OwnedSockets:
    """The sockets one owner made in its :class:`PrivateContext`, closed exactly once.

    :meth:`close` is the owner's ``aclose()``; :meth:`drop`, registered by :meth:`watch`,
    its finalizer. ``loop`` is the event loop that last drove the sockets, set by the owner.
    """

    def __init__(
        self, context: PrivateContext, *, cleanup: Callable[[], None] | None = None
    ) -> None:
        self._context = context
        self._sockets: list[tuple[zmq.Socket[Any], bool]] = []
        self._cleanup = cleanup
        self._closed = False
        self._guard = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def closed(self) -> bool:
        """True once the sockets and the context are closed."""
        return self._closed

    def watch(self, owner: object) -> None:
        """Close the sockets (:meth:`drop`) once ``owner`` is garbage, unless closed before.

        Not at interpreter exit, where a daemon thread's loop may still drive them: as
        pyzmq does, what is open then is left to the process's end.
        """
        weakref.finalize(owner, self.drop).atexit = False

    def add(self, socket: zmq.Socket[Any], *, flush: bool) -> None:
        """Own ``socket``; ``flush``: :meth:`close` gives it the owner's linger, else 0."""
        self._sockets.append((socket, flush))

    def close(self, linger_ms: int) -> bool:
        """Close the sockets in the order added, then the context; False if already closed.

        Sockets that ``flush`` may still send what they queued for ``linger_ms``; the
        context's ``term()`` waits at most that long, as every socket made in it is closed.
        """
        with self._guard:
            if self._closed:
                return False
            self._closed = True
        for socket, flush in self._sockets:
            socket.close(linger=linger_ms if flush else 0)
        self._context.term()
        return True

    def drop(self) -> None:
        """Close with linger 0, never waiting: the owner was dropped without ``aclose()``.

        On the loop that last drove the sockets while it still runs (a callback there),
        here otherwise; what the owner asked to clean up (a socket file) follows the close.
        """
        loop = self.loop
        if loop is not None and loop.is_running():
            with contextlib.suppress(RuntimeError):  # it closed meanwhile: close here
                loop.call_soon_threadsafe(self._dropped)
                return
        self._dropped()

    def _dropped(self) -> None:
        try:
            if self.close(0) and self._cleanup is not None:
                self._cleanup()
        except Exception as exc:  # a finalizer has no caller to tell
            log.debug("closing dropped sockets: %r", exc)

    def __del__(self) -> None:
        # A close handed to a loop that was closed before running it ends up here.
        if not getattr(self, "_closed", True) and not sys.is_finalizing():
            self._dropped()
