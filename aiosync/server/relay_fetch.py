"""A relay's fetch of the buckets it lacks: chunks in a window, each copied once, into place.

The relay (:mod:`aiosync.server.relay`) asks its upstream for every missing bucket in
chunks of :data:`~aiosync.server.messages.CHUNK_BYTES`, several in flight: at most
``Window.chunks`` chunks' bytes asked for and not yet in place, so what the relay buffers
and what the upstream queues for it stay bounded however large a bucket is, and a link's
round trips overlap. A chunk arrives as a view of libzmq's own buffer (nothing is copied
out of a message) and goes to its bucket's *lane*, a worker thread that copies it into
the bucket's shared-memory segment, the very one the store then retains, and hashes it
there (SHA-256, incrementally, a block at a time while it is in cache). A bucket's last
chunk in, its lane checks the bucket against its digest; so hashing overlaps the network
and runs on as many cores as there are lanes, and the event loop only receives, checks
each header against what it asked for, and asks for more.

Bad input from the upstream ends the fetch with an error naming the version, the bucket
and the offset awaited: a chunk other than the one asked for next (another bucket, another
offset, past its bucket), bytes fewer or more than asked for (truncated, oversize), a
message of other than two parts, a refusal; a frame over the relay's ``max_message_bytes``
makes libzmq drop the connection before buffering it, and is reported so; and a bucket
whose bytes do not match its digest.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import numpy as np

import aiosync.server.messages as m
from aiosync.channels.base import PartsChannel
from aiosync.core.errors import (
    AiosyncError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.planes.shm import ShmSegment

BLOCK = 1 << 20
"""Bytes a lane copies, then hashes, at a time (they are still in cache for the hash)."""


@contextmanager
def bounded(seconds: float, what: str, peer: str) -> Iterator[None]:
    """A wait of at most ``seconds``; past it a :class:`SyncTimeoutError` naming the peer."""
    with anyio.move_on_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        raise SyncTimeoutError(f"no {what} within {seconds:g}s", peer=peer)


@dataclass(frozen=True)
class Window:
    """How a fetch runs: bytes per chunk, chunks in flight, lanes, and its bounds.

    ``max_frame``: the largest frame the relay's socket takes (libzmq drops the connection
    on a larger one); ``timeout``: the longest wait for any one chunk.
    """

    chunk: int = m.CHUNK_BYTES
    chunks: int = 8
    lanes: int = 4
    timeout: float = 60.0
    max_frame: int = m.MAX_CHUNK_BYTES


class BucketFill:
    """One bucket arriving: its chunks copied into its segment and hashed, in order.

    ``reserve(used)`` gives the segment (from the store, in the lane's thread, when the
    first chunk is placed). :meth:`place` runs in the bucket's lane only.
    """

    def __init__(
        self, index: int, bucket: m.BucketHead, reserve: Callable[[int], ShmSegment]
    ) -> None:
        self.index = index
        self.bucket = bucket
        self.segment: ShmSegment | None = None
        self._reserve = reserve
        self._hash = hashlib.sha256()

    def place(self, offset: int, data: memoryview) -> None:
        """Copy one chunk into the segment at ``offset`` and hash it (chunks come in order)."""
        if self.segment is None:
            self.segment = self._reserve(self.bucket.used)
        target = self.segment.tensor.numpy()
        source = np.frombuffer(data, dtype=np.uint8)
        for start in range(0, len(source), BLOCK):
            block = source[start : start + BLOCK]
            np.copyto(target[offset + start : offset + start + len(block)], block)
            self._hash.update(block.data)

    def matches(self) -> bool:
        """Whether the bytes placed hash to the bucket's digest (once all are placed)."""
        return self._hash.digest() == self.bucket.digest


def chunks_of(fills: list[BucketFill], chunk: int) -> Iterator[tuple[BucketFill, int, int]]:
    """(bucket, offset, bytes) of every chunk to ask for, bucket by bucket, in order (pure)."""
    for fill in fills:
        for offset in range(0, fill.bucket.used, chunk):
            yield fill, offset, min(chunk, fill.bucket.used - offset)


async def fetch(
    channel: PartsChannel,
    version: int,
    fills: list[BucketFill],
    window: Window,
    *,
    whole: Callable[[BucketFill], None],
    upstream: str,
) -> int:
    """Receive every bucket of ``fills``; returns the bytes received.

    ``whole(fill)`` runs in the bucket's lane once it is in place and matches its digest.
    On any failure the lanes are stopped and waited for before this returns: no thread
    writes a segment after it.
    """
    lanes = [ThreadPoolExecutor(1, "aiosync-relay") for _ in range(max(1, window.lanes))]
    lane_of = {id(fill): lanes[i % len(lanes)] for i, fill in enumerate(fills)}
    wanted = chunks_of(fills, window.chunk)
    asked: collections.deque[tuple[BucketFill, int, int]] = collections.deque()
    placing: collections.deque[tuple[Future[None], int]] = collections.deque()
    room, in_flight, received = window.chunk * window.chunks, 0, 0
    following = next(wanted, None)
    try:
        while True:
            while placing and placing[0][0].done():
                done, nbytes = placing.popleft()
                done.result()
                in_flight -= nbytes
            while following is not None and (in_flight + following[2] <= room or not in_flight):
                fill, offset, nbytes = following
                await channel.send(m.encode(m.Get(version, fill.index, offset, nbytes)))
                asked.append(following)
                in_flight += nbytes
                following = next(wanted, None)
            if asked:
                fill, offset, nbytes = asked.popleft()
                data = await _chunk(
                    channel, version, (fill.index, offset, nbytes), window, upstream
                )
                received += nbytes
                last = offset + nbytes == fill.bucket.used
                work = lane_of[id(fill)].submit(_place, fill, offset, data, last, whole, version)
                placing.append((work, nbytes))
            elif placing:
                done, nbytes = placing.popleft()
                await asyncio.wrap_future(done)
                in_flight -= nbytes
            else:
                for lane in lanes:
                    lane.shutdown(wait=False)
                return received
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_stop, lanes)
        raise


def _stop(lanes: list[ThreadPoolExecutor]) -> None:
    """Drop what the lanes have not started, and wait for what they are doing."""
    for lane in lanes:
        lane.shutdown(wait=True, cancel_futures=True)


def _place(
    fill: BucketFill,
    offset: int,
    data: memoryview,
    last: bool,
    whole: Callable[[BucketFill], None],
    version: int,
) -> None:
    fill.place(offset, data)
    if not last:
        return
    if not fill.matches():
        raise ProtocolError(f"bucket {fill.index} does not match its digest", version=version)
    whole(fill)


def gone(exc: PeerGoneError, awaited: str, max_frame: int, version: int | None) -> PeerGoneError:
    """The upstream's connection dropped while ``awaited`` was: say what may have done it."""
    return PeerGoneError(
        f"the upstream went while {awaited} was awaited ({exc.reason}; a frame over "
        f"max_message_bytes, {max_frame} bytes, ends the connection so)",
        peer=exc.peer,
        version=version,
    )


async def _chunk(
    channel: PartsChannel,
    version: int,
    asked: tuple[int, int, int],
    window: Window,
    upstream: str,
) -> memoryview:
    """The bytes of the chunk asked for next, checked against what was asked."""
    index, offset, nbytes = asked
    where = f"bucket {index} at byte {offset}"
    try:
        with bounded(window.timeout, f"chunk of {where}", upstream):
            parts = await channel.recv_parts()
    except PeerGoneError as exc:
        raise gone(exc, where, window.max_frame, version) from None
    reply = m.decode_reply(parts[0], window.max_frame)
    if isinstance(reply, m.Refused):
        raise RejectedError(reply.reason, peer=upstream, version=version)
    if isinstance(reply, m.Closing):
        raise AiosyncError(f"upstream closing: {reply.reason}", peer=upstream, version=version)
    if not isinstance(reply, m.Chunk) or (reply.version, reply.bucket, reply.offset) != (
        version,
        index,
        offset,
    ):
        got = type(reply).__name__
        if isinstance(reply, m.Chunk):
            got = f"bucket {reply.bucket} at byte {reply.offset} of version {reply.version}"
        raise ProtocolError(f"expected {where}, got {got}", peer=upstream, version=version)
    if len(parts) != 2 or reply.nbytes != nbytes or len(parts[1]) != nbytes:
        size = len(parts[1]) if len(parts) == 2 else f"{len(parts)} parts"
        raise ProtocolError(
            f"{where}: asked for {nbytes} bytes, the chunk says {reply.nbytes} and carries {size}",
            peer=upstream,
            version=version,
        )
    return parts[1]
