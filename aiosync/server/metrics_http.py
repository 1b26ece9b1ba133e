"""A small HTTP server that slow or idle clients cannot exhaust (the metrics endpoint's).

The standard library's ``ThreadingHTTPServer`` (and ``prometheus_client``'s
``start_http_server``, a ``ThreadingMixIn`` server too) gives every connection a thread of
its own, and that thread waits for the request without a deadline: a client that connects
and sends half a request holds a thread and a descriptor for as long as it likes. Here one
thread reads every connection's request head without blocking, and a connection whose head
has not arrived within ``read_timeout`` seconds of its accept is closed. Only a complete
request reaches a worker, at most ``concurrency`` at once (a pool of that many threads); a
request that finds them all busy is answered 503 at once. At most
:data:`WAITING_PER_WORKER` times ``concurrency`` connections wait for their head; past that
the one that has waited longest is closed. A worker's writes are bounded by
``read_timeout`` too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import socketserver
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger(__name__)

HEAD_BYTES = 64 << 10
"""Largest request head read (a longer one closes the connection)."""

WAITING_PER_WORKER = 8
"""Connections that may wait for their request head, per worker."""

BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 5\r\nRetry-After: 1\r\nConnection: close\r\n\r\nbusy\n"
)


class HeadReadHandler(BaseHTTPRequestHandler):
    """A request handler for :class:`BoundedHTTPServer`, which has read the request head.

    Its request is ``(head, connection)``, as a datagram server's is ``(data, socket)``;
    the handler parses the head from memory and writes its answer to the connection.
    """

    def setup(self) -> None:
        """Read from the head already received; write to the connection."""
        assert isinstance(self.request, tuple)
        head, self.connection = self.request
        self.rfile = io.BytesIO(head)
        self.wfile = self.connection.makefile("wb")


@dataclass
class _Waiting:
    """A connection whose request head has not arrived yet."""

    address: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class BoundedHTTPServer(socketserver.TCPServer):
    """An HTTP server with ``concurrency`` workers and a ``read_timeout`` per connection.

    Serves :class:`HeadReadHandler` subclasses; :meth:`serve_forever` in one thread,
    :meth:`shutdown` from another, then :meth:`server_close`, as for ``socketserver``.
    """

    allow_reuse_address = True
    request_queue_size = 128  # connections the kernel queues before the accept

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[HeadReadHandler],
        *,
        concurrency: int = 8,
        read_timeout: float = 5.0,
    ) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency!r}")
        if not read_timeout > 0:  # also NaN
            raise ValueError(f"read_timeout must be positive, got {read_timeout!r}")
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        # made before the bind: a failed bind calls server_close, which closes them
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        super().__init__(address, handler)
        self._handler = handler
        self.concurrency = concurrency
        self.read_timeout = read_timeout
        self.socket.setblocking(False)
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._free = threading.BoundedSemaphore(concurrency)
        self._workers = ThreadPoolExecutor(concurrency, thread_name_prefix="aiosync-metrics")
        self._waiting: OrderedDict[socket.socket, _Waiting] = OrderedDict()  # by deadline

    @property
    def waiting(self) -> int:
        """Connections waiting for their request head now."""
        return len(self._waiting)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, read and dispatch until :meth:`shutdown` (``poll_interval`` is unused)."""
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self.socket, selectors.EVENT_READ)
                selector.register(self._wake_read, selectors.EVENT_READ)
                while not self._stopping.is_set():
                    for key, _ in selector.select(self._until_next_deadline()):
                        if key.fileobj is self.socket:
                            self._accept(selector)
                        elif key.fileobj is self._wake_read:
                            self._wake_read.recv(64)
                        else:
                            assert isinstance(key.fileobj, socket.socket)
                            self._read(selector, key.fileobj)
                    self._expire(selector, time.monotonic())
                for connection in list(self._waiting):
                    self._drop(selector, connection)
        finally:
            self._workers.shutdown(wait=True)  # each is bounded by read_timeout
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait for it and the requests in flight to end."""
        self._stopping.set()
        self._wake_write.send(b"x")
        self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket."""
        super().server_close()
        self._wake_read.close()
        self._wake_write.close()

    # --- the reading thread -----------------------------------------------------------

    def _until_next_deadline(self) -> float | None:
        first = next(iter(self._waiting.values()), None)
        return None if first is None else max(0.0, first.deadline - time.monotonic())

    def _accept(self, selector: selectors.BaseSelector) -> None:
        for _ in range(self.concurrency * WAITING_PER_WORKER):
            try:
                connection, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next select tries again
                log.debug("metrics: accept failed: %s", exc)
                return
            if len(self._waiting) >= self.concurrency * WAITING_PER_WORKER:
                self._drop(selector, next(iter(self._waiting)))
            connection.setblocking(False)
            deadline = time.monotonic() + self.read_timeout
            self._waiting[connection] = _Waiting(address, deadline)
            selector.register(connection, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, connection: socket.socket) -> None:
        waiting = self._waiting.get(connection)
        if waiting is None:
            return
        try:
            data = connection.recv(HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        head = waiting.head
        start = max(0, len(head) - 2)
        head += data
        if not data or len(head) > HEAD_BYTES:
            self._drop(selector, connection)
        elif head.find(b"\n\n", start) >= 0 or head.find(b"\n\r\n", start) >= 0:
            selector.unregister(connection)
            del self._waiting[connection]
            self._dispatch(connection, bytes(head), waiting.address)

    def _expire(self, selector: selectors.BaseSelector, now: float) -> None:
        while self._waiting:
            connection, waiting = next(iter(self._waiting.items()))
            if waiting.deadline > now:
                return
            log.debug("metrics: no request from %s within %gs", waiting.address, self.read_timeout)
            self._drop(selector, connection)

    def _drop(self, selector: selectors.BaseSelector, connection: socket.socket) -> None:
        selector.unregister(connection)
        del self._waiting[connection]
        connection.close()

    def _dispatch(self, connection: socket.socket, head: bytes, address: Any) -> None:
        if not self._free.acquire(blocking=False):
            with contextlib.suppress(OSError):
                connection.send(BUSY)  # non-blocking: whatever fits, then closed
            connection.close()
            return
        connection.settimeout(self.read_timeout)
        try:
            self._workers.submit(self._answer, connection, head, address)
        except RuntimeError:  # shutting down
            self._free.release()
            connection.close()

    # --- the workers ------------------------------------------------------------------

    def _answer(self, connection: socket.socket, head: bytes, address: Any) -> None:
        try:
            self._handler((head, connection), address, self)
        except OSError as exc:  # a client gone or too slow to read its answer
            log.debug("metrics: answer to %s failed: %s", address, exc)
        except Exception:
            log.exception("metrics: answering %s failed", address)
        finally:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_WR)
            connection.close()
            self._free.release()
