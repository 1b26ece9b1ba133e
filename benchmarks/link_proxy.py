"""A link slower than loopback, without root: a TCP proxy that paces and delays what it forwards.

    python -m benchmarks.link_proxy serve --target 127.0.0.1:PORT --rate-gbit 10 --latency-ms 0.2
    python -m benchmarks.link_proxy bench --rate-gbit 10 --latency-ms 0.2 --size-mb 256

``serve`` listens on loopback (``--listen``, default any free port), prints one JSON line
``{"event": "ready", "listen": "tcp://127.0.0.1:PORT"}`` and forwards every connection it
accepts to ``--target``, both ways, until its standard input closes or it is signalled.
Each direction of each connection is its own link: what is read from one side is sent on
to the other no faster than ``--rate-gbit`` (a token bucket of ``--burst-kib``), and each
chunk read is held for ``--latency-ms`` after the link has carried it, so every round trip
of the protocol above pays twice the latency, as it would between two hosts. Network
namespaces and ``tc`` would do this in the kernel, but need root; this needs nothing.
What the proxy holds per direction is bounded (``queue_bytes``), so a sender faster than
the link is held back by TCP, as a real link holds it.

``bench`` runs a relay pull through such a link, beside raw ZMQ tcp of the same bytes
through another (both with the same CURVE setting, :mod:`benchmarks.relay_rate`), and
reports each transfer's seconds against bytes / link rate.

The pacing is :class:`Link` (pure: times in, times out); :class:`LinkProxy` is the sockets
and threads around it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

CHUNK = 256 << 10
"""Bytes read from a socket at once: the unit the link paces and delays."""


@dataclass
class Link:
    """One direction of a link: ``rate`` bytes/s through a token bucket, then ``latency`` s.

    :meth:`deliver` says when a chunk that the proxy read at ``arrival`` reaches the far
    side: the bucket lets it depart once it holds the chunk's bytes in tokens (filled at
    ``rate``, at most ``burst``) and not before the chunk ahead of it departed (order is
    kept); it then arrives ``latency`` seconds later. Chunks of more than ``burst`` bytes
    wait for ``burst`` tokens and leave the bucket in debt, so the long-run rate holds.
    Pure: the caller passes every time.
    """

    rate: float
    latency: float
    burst: int = CHUNK
    tokens: float = field(init=False)
    at: float = field(init=False, default=float("-inf"))  # when ``tokens`` was counted

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.latency < 0 or self.burst <= 0:
            raise ValueError(
                f"a link needs rate > 0, latency >= 0, burst > 0: {self.rate}, "
                f"{self.latency}, {self.burst}"
            )
        self.tokens = float(self.burst)

    def depart(self, arrival: float, nbytes: int) -> float:
        """When a chunk of ``nbytes`` read at ``arrival`` leaves the bucket (and pays for it)."""
        start = max(arrival, self.at)  # never before the chunk ahead of it
        tokens = min(float(self.burst), self.tokens + (start - self.at) * self.rate)
        needed = min(nbytes, self.burst)
        if tokens < needed:
            start += (needed - tokens) / self.rate
            tokens = float(needed)
        self.tokens, self.at = tokens - nbytes, start
        return start

    def deliver(self, arrival: float, nbytes: int) -> float:
        """When a chunk of ``nbytes`` read at ``arrival`` is handed to the far side."""
        return self.depart(arrival, nbytes) + self.latency


def queue_bytes(rate: float, latency: float) -> int:
    """What one direction may hold: the bytes in flight on the link, twice, and 16 chunks."""
    return int(2 * rate * latency) + 16 * CHUNK


class Direction:
    """One way of one connection: a reader thread queues chunks, a writer sends them when due.

    ``forwarded`` counts the bytes sent on. End of stream on the source shuts the
    destination's write side once everything queued before it is sent.
    """

    def __init__(self, source: socket.socket, sink: socket.socket, link: Link) -> None:
        self.source, self.sink, self.link = source, sink, link
        self.limit = queue_bytes(link.rate, link.latency)
        self.forwarded = 0
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued = 0
        self._ready = threading.Condition()
        self.threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._write, daemon=True),
        ]

    def start(self) -> None:
        """Start both threads."""
        for thread in self.threads:
            thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.source.recv(CHUNK)
            except OSError:
                data = b""
            arrival = time.monotonic()
            with self._ready:
                while data and self._queued + len(data) > self.limit:
                    self._ready.wait()
                self._queue.append((arrival, data))
                self._queued += len(data)
                self._ready.notify_all()
            if not data:
                return

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                arrival, data = self._queue.popleft()
            if not data:
                with contextlib.suppress(OSError):
                    self.sink.shutdown(socket.SHUT_WR)
                return
            wait = self.link.deliver(arrival, len(data)) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                self.sink.sendall(data)
            except OSError:
                with contextlib.suppress(OSError):
                    self.source.shutdown(socket.SHUT_RD)
                return
            finally:
                with self._ready:
                    self._queued -= len(data)
                    self._ready.notify_all()
            self.forwarded += len(data)


class LinkProxy:
    """Forwards each connection to ``listen`` on to ``target``, each direction through a link.

    ``rate`` in bytes/s, ``latency`` in seconds (one way). Runs in daemon threads from
    :meth:`start` until :meth:`close`. ``forwarded`` totals the bytes sent on, both ways.
    """

    def __init__(
        self,
        target: tuple[str, int],
        rate: float,
        latency: float,
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        burst: int = CHUNK,
    ) -> None:
        Link(rate, latency, burst)  # checks the numbers now
        self.target, self.rate, self.latency, self.burst = target, rate, latency, burst
        self._server = socket.create_server(listen)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._directions: list[Direction] = []
        self._sockets: list[socket.socket] = []
        self._closed = False

    @property
    def endpoint(self) -> str:
        """``tcp://HOST:PORT``, where peers connect to reach ``target``."""
        return f"tcp://{self.address[0]}:{self.address[1]}"

    @property
    def forwarded(self) -> int:
        """Bytes sent on so far, both directions of every connection."""
        return sum(direction.forwarded for direction in self._directions)

    def start(self) -> LinkProxy:
        """Accept connections in a daemon thread; returns itself."""
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                near, _ = self._server.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(self.target)
            except OSError:
                near.close()
                continue
            for sock in (near, far):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(sock)
            for source, sink in ((near, far), (far, near)):
                direction = Direction(source, sink, Link(self.rate, self.latency, self.burst))
                self._directions.append(direction)
                direction.start()

    def close(self) -> None:
        """Stop accepting and close every connection (idempotent)."""
        self._closed = True
        self._server.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` as a socket address."""
    host, _, port = text.removeprefix("tcp://").rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def serve(args: argparse.Namespace) -> None:
    """Run one proxy until standard input closes (or SIGTERM)."""
    rate, latency = args.rate_gbit * 1e9 / 8, args.latency_ms / 1e3
    proxy = LinkProxy(
        host_port(args.target),
        rate,
        latency,
        listen=host_port(args.listen),
        burst=args.burst_kib << 10,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with proxy:
        print(json.dumps({"event": "ready", "listen": proxy.endpoint}), flush=True)
        sys.stdin.read()  # until the parent closes it or goes


def main() -> None:
    """``serve`` or ``bench`` (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.link_proxy")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "bench"):
        sub = commands.add_parser(name)
        sub.add_argument("--rate-gbit", type=float, default=10.0)
        sub.add_argument("--latency-ms", type=float, default=0.2)
        sub.add_argument("--burst-kib", type=int, default=CHUNK >> 10)
    serving = commands.choices["serve"]
    serving.add_argument("--target", required=True, metavar="HOST:PORT")
    serving.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    benching = commands.choices["bench"]
    benching.add_argument("--size-mb", type=int, default=256)
    benching.add_argument("--repeats", type=int, default=3)
    benching.add_argument("--curve", default="off", help="off, on, or off,on")
    benching.add_argument("--tree", help="take the package from this checkout")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args)
        return
    from benchmarks.relay_rate import run_bench, use_tree

    if args.tree:
        use_tree(args.tree)

    print(json.dumps(run_bench(args, link=(args.rate_gbit, args.latency_ms, args.burst_kib))))


if __name__ == "__main__":
    main()
