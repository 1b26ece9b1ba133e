"""Polling a ZMQ socket without sleeping, for a bounded time, while a version is in flight.

A process that sleeps in ``epoll`` between two messages pays for its wake-up when the next
one arrives: 0.15-0.6 ms on the shared GPU hosts (docs/benchmarks.md), about as long as a
small bucket's whole trip. While a version streams over CUDA, messages are that close
together, so a waiting side may instead look at its socket on every turn of its event
loop for up to a budget of seconds, then sleep as before. The loop stays free: each look
is followed by a checkpoint, so every other task runs between two looks. The price is one
busy core for at most the budget per wait, and only while a version is in flight.
"""

from __future__ import annotations

import time
from typing import cast

import anyio.lowlevel
import zmq
import zmq.asyncio

CUDA_BUSY_POLL = 0.02
"""The budget (seconds) used where a side's data plane is CUDA and none was configured.

Long enough to cover a whole direct version of an 8-billion-parameter model (about 10 ms on
an H200); CPU planes move bytes at memcpy speed, where a wake-up is a small part of a
bucket, and keep 0.
"""


def resolve_busy_poll(configured: float | None, cuda: bool) -> float:
    """The budget in seconds: ``configured``, or :data:`CUDA_BUSY_POLL` on CUDA and 0 else."""
    if configured is not None:
        return configured
    return CUDA_BUSY_POLL if cuda else 0.0


def readable(socket: zmq.asyncio.Socket) -> bool:
    """Whether a message waits on ``socket`` now (no syscall beyond libzmq's own)."""
    return bool(cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


async def poll_briefly(socket: zmq.asyncio.Socket, budget: float) -> list[bytes] | None:
    """The next message's frames if one is waiting or arrives within ``budget`` seconds.

    Looks once with ``budget`` 0. Returns None, having never slept, when nothing came; the
    caller then waits as usual.
    """
    deadline = time.monotonic() + budget
    while True:
        if readable(socket):
            try:
                frames = await socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                return frames
        if time.monotonic() >= deadline:
            return None
        await anyio.lowlevel.checkpoint()
