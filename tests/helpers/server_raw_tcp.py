"""The raw baseline for the relay benchmark: send N bytes over plain ZMQ tcp.

Run as ``python -m tests.helpers.server_raw_tcp ENDPOINT BYTES``: connects a PUSH socket to
``ENDPOINT`` (the benchmark's PULL, loopback) and sends ``BYTES`` in 4 MiB messages from
one buffer, as fast as ZMQ takes them.
"""

from __future__ import annotations

import sys

import zmq

CHUNK = 4 << 20


def main() -> None:
    endpoint, total = sys.argv[1], int(sys.argv[2])
    data = bytes(CHUNK)
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
        sock.connect(endpoint)
        sent = 0
        while sent < total:
            n = min(CHUNK, total - sent)
            sock.send(data[:n], copy=False)
            sent += n
        sock.setsockopt(zmq.LINGER, 60_000)


if __name__ == "__main__":
    main()
