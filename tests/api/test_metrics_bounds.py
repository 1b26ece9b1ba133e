"""The metrics endpoint under slow clients (issue 26, item 5): clients that connect and send
half a request hold no threads and are closed at the read timeout, at most ``concurrency``
requests are answered at once (more get 503), and a normal scrape works meanwhile."""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest

from aiosync.server import ServerConfig, WeightServer
from aiosync.server.metrics import MetricsEndpoint, ServerMetrics
from aiosync.server.metrics_http import HEAD_BYTES

WAIT = 30.0
HALF = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # the blank line never comes


def healthy() -> tuple[bool, dict[str, Any]]:
    return True, {"ready": True}


@contextmanager
def endpoint(
    health: Callable[[], tuple[bool, dict[str, Any]]] = healthy, **bounds: Any
) -> Iterator[MetricsEndpoint]:
    http = MetricsEndpoint(ServerMetrics(), health, **bounds)
    http.start()
    try:
        yield http
    finally:
        http.close()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def half_requests(address: str, count: int) -> list[socket.socket]:
    """``count`` connections that each sent half a request."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    clients = []
    for _ in range(count):
        client = socket.create_connection((host, int(port)), timeout=WAIT)
        client.sendall(HALF)
        clients.append(client)
    return clients


def closed_by_server(client: socket.socket) -> bool:
    """Whether the server closes ``client`` (EOF, or a reset) before WAIT seconds pass."""
    try:
        while True:
            data = client.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        client.close()


def test_slow_clients_hold_no_threads_are_closed_at_the_timeout_and_scrapes_go_on() -> None:
    before = threading.active_count()
    with endpoint(concurrency=4, read_timeout=0.5) as http:
        assert get(http.address + "/metrics")[0] == 200
        clients = half_requests(http.address, 40)
        try:
            for _ in range(3):  # while they hang, scrapes are answered
                status, body = get(http.address + "/metrics")
                assert status == 200
                assert b"aiosync_versions_published_total" in body
            # the reading thread and at most 4 workers, whatever the slow clients do
            assert threading.active_count() <= before + 1 + 4
            assert all(closed_by_server(client) for client in clients)
        finally:
            for client in clients:
                client.close()
        assert get(http.address + "/healthz")[0] == 200
    assert threading.active_count() <= before


def test_a_request_finding_every_worker_busy_gets_503() -> None:
    inside, release = threading.Event(), threading.Event()

    def stuck() -> tuple[bool, dict[str, Any]]:
        inside.set()
        release.wait(WAIT)
        return True, {}

    with endpoint(stuck, concurrency=1, read_timeout=WAIT) as http:
        first: list[int] = []
        worker = threading.Thread(target=lambda: first.append(get(http.address + "/healthz")[0]))
        worker.start()
        try:
            assert inside.wait(WAIT)  # the only worker is answering it
            status, body = get(http.address + "/metrics")
            assert (status, body) == (503, b"busy\n")
        finally:
            release.set()
            worker.join(WAIT)
        assert first == [200]
        assert get(http.address + "/metrics")[0] == 200  # the worker is free again


def test_an_endless_request_head_is_cut_off() -> None:
    with endpoint(read_timeout=WAIT) as http:
        (client,) = half_requests(http.address, 1)
        with contextlib.suppress(OSError):  # closed already
            client.sendall(b"X-Filler: " + b"a" * HEAD_BYTES)  # never a blank line
        assert closed_by_server(client)


def test_waiting_connections_are_bounded() -> None:
    with endpoint(concurrency=1, read_timeout=WAIT) as http:
        clients = half_requests(http.address, 12)  # 8 may wait with one worker
        try:
            assert closed_by_server(clients[0])  # the one that waited longest made room
            assert get(http.address + "/metrics")[0] == 200
        finally:
            for client in clients:
                client.close()


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ServerConfig(metrics_concurrency=0)
    with pytest.raises(ValueError, match="read_timeout"):
        ServerConfig(metrics_read_timeout=float("nan"))
    with pytest.raises(ValueError, match="read_timeout"):
        MetricsEndpoint(ServerMetrics(), healthy, read_timeout=0)


async def test_the_servers_endpoint_takes_its_bounds_from_the_config() -> None:
    config = ServerConfig(metrics_port=0, metrics_read_timeout=0.5, timeout=WAIT)
    async with WeightServer(config) as server:
        address = server.metrics_address
        assert address is not None
        clients = await anyio.to_thread.run_sync(half_requests, address, 10)
        status, _ = await anyio.to_thread.run_sync(get, address + "/healthz")
        assert status == 503  # answered (nothing published yet), while they hang
        for client in clients:
            assert await anyio.to_thread.run_sync(closed_by_server, client)


def test_serve_takes_the_metrics_bounds() -> None:
    from aiosync.cli.args import build_parser

    parser = build_parser({})
    args = parser.parse_args(
        ["serve", "--metrics-concurrency", "2", "--metrics-read-timeout", "0.25"]
    )
    assert (args.metrics_concurrency, args.metrics_read_timeout) == (2, 0.25)
    defaults = parser.parse_args(["serve"])
    assert (defaults.metrics_concurrency, defaults.metrics_read_timeout) == (8, 5.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--metrics-concurrency", "0"])


def test_a_port_in_use_is_an_oserror_and_leaks_nothing() -> None:
    """A failed bind closes what the server made before it (no AttributeError on the way)."""
    import socket

    from aiosync.server.metrics_http import BoundedHTTPServer, HeadReadHandler

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="in use"):
            BoundedHTTPServer(("127.0.0.1", port), HeadReadHandler)
