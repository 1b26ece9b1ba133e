"""The link-limited runs' proxy (issue 29, item 3): its pacing maths, and bytes through it.

The maths is pure (times in, times out), so it is checked exactly; the proxy is checked
only for what it forwards (every byte, in order, both ways), never for wall time.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from benchmarks.link_proxy import CHUNK, Link, LinkProxy, host_port, queue_bytes

GBIT = 1e9 / 8


def test_back_to_back_chunks_leave_at_the_link_rate_after_one_burst() -> None:
    link = Link(rate=1000.0, latency=0.5, burst=100)
    # ten chunks of 100 bytes, all read at t=0: the first goes at once, then one each 0.1 s
    departures = [link.depart(0.0, 100) for _ in range(10)]
    assert departures == pytest.approx([0.1 * i for i in range(10)])
    # and each is handed on ``latency`` after it left the bucket
    again = Link(rate=1000.0, latency=0.5, burst=100)
    assert [again.deliver(0.0, 100) for _ in range(3)] == pytest.approx([0.5, 0.6, 0.7])


def test_an_idle_link_refills_its_bucket_up_to_the_burst_only() -> None:
    link = Link(rate=1000.0, latency=0.0, burst=100)
    assert link.depart(0.0, 100) == 0.0  # the bucket starts full
    assert link.depart(0.05, 100) == pytest.approx(0.1)  # half refilled: waits the rest
    assert link.depart(10.0, 100) == 10.0  # long idle: full again, not more
    assert link.depart(10.0, 100) == pytest.approx(10.1)  # so the next one waits


def test_order_is_kept_and_small_chunks_share_the_rate() -> None:
    link = Link(rate=1000.0, latency=0.2, burst=100)
    times = [link.deliver(0.001 * i, 10) for i in range(100)]  # 1000 bytes read in 0.1 s
    assert times == sorted(times)
    assert times[-1] == pytest.approx(0.2 + (1000 - 100) / 1000.0)  # one burst, then the rate


def test_a_chunk_past_the_burst_leaves_the_bucket_in_debt() -> None:
    link = Link(rate=1000.0, latency=0.0, burst=100)
    assert link.depart(0.0, 500) == 0.0  # waits only for a full bucket
    assert link.depart(0.0, 100) == pytest.approx(0.5)  # then pays off the 400 it owed


def test_long_runs_hold_the_rate() -> None:
    link = Link(rate=10 * GBIT, latency=0.0002)
    total = 256 << 20
    last = 0.0
    for _ in range(total // CHUNK):
        last = link.deliver(0.0, CHUNK)
    assert last == pytest.approx(0.0002 + (total - CHUNK) / (10 * GBIT))


def test_bad_links_are_refused_and_the_queue_holds_what_is_in_flight() -> None:
    for rate, latency, burst in ((0.0, 0.1, 1), (1.0, -1.0, 1), (1.0, 0.0, 0)):
        with pytest.raises(ValueError, match="a link needs"):
            Link(rate, latency, burst)
    in_flight = int(10 * GBIT * 0.0002)
    assert queue_bytes(10 * GBIT, 0.0002) >= 2 * in_flight + CHUNK
    assert host_port("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert host_port("[::1]:7") == ("::1", 7)


def echo_server() -> tuple[socket.socket, threading.Thread]:
    """A server that sends back exactly what it reads, then closes its side."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_bytes_cross_the_proxy_intact_and_in_order_both_ways() -> None:
    server, thread = echo_server()
    payload = os.urandom(3 * CHUNK + 12345)  # several chunks, the last a partial one
    got = bytearray()
    with server, LinkProxy(server.getsockname()[:2], rate=GBIT, latency=0.0001) as proxy:
        with socket.create_connection(proxy.address, timeout=30) as conn:

            def send() -> None:
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)

            sender = threading.Thread(target=send)
            sender.start()
            while data := conn.recv(1 << 16):
                got += data
            sender.join(30)
        thread.join(30)
        assert bytes(got) == payload  # there and back, every byte, in order
        assert proxy.forwarded == 2 * len(payload)
        assert proxy.endpoint == f"tcp://127.0.0.1:{proxy.address[1]}"
