"""The upstream's side of a relay's pull: a version's head, then its bytes straight from memory.

A server answers a relay's ``pull`` with the newest version's
:class:`~aiosync.server.messages.Head` (each bucket's bytes, SHA-256 digest and specs) and
each ``get`` with one :class:`~aiosync.server.messages.Chunk`: a header, then the range's
bytes as a second message part sent from the retained segment itself, never copied into a
message (libzmq reads them from the segment as it writes the socket; CURVE encrypts them
there). The relay (:mod:`aiosync.server.relay`) checks every bucket against its digest, so
bytes that changed under a send (a version evicted and its memory reused while a chunk
was still queued) are refused there, never retained.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

import aiosync.server.messages as m
from aiosync.channels.base import Channel, Delivery, PartsChannel
from aiosync.server.relay_fetch import bounded
from aiosync.server.store import RetentionStore

QUEUED_CHUNKS = 8
"""Chunks of one relay's that may wait in the socket's queue while the next is queued; past
that a ``get`` waits (within the timeout) for the oldest to be written out. A relay that
does not read holds so little more of this server's memory than the bytes it asked for."""

POLL = 0.0005
"""Seconds between looks at whether a queued chunk was written out."""


@dataclass
class RelayDesk:
    """A server's answers to relays: the version each relay channel pulled.

    A version is pinned only while one of its chunks is being queued: a relay that goes
    away silently holds nothing, and one whose version was evicted between two chunks is
    refused and pulls again (keeping, by digest, what it already received).
    """

    store: RetentionStore
    changed: Callable[[], anyio.Event]
    pulled: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0  # bucket bytes sent to relays, all channels together
    queued: dict[str, collections.deque[Delivery]] = field(default_factory=dict)

    def release(self, peer: str) -> None:
        """The channel ended: forget what it pulled."""
        self.pulled.pop(peer, None)
        self.queued.pop(peer, None)

    async def pull(self, channel: Channel, request: m.Pull, max_wait: float) -> m.Reply:
        """Wait for a version newer than the relay's; answer with its head.

        From the first pull on, the store hashes every version as it arrives.
        """
        self.store.hash_ahead()
        with anyio.move_on_after(m.bounded_wait(request.timeout, max_wait)):
            while True:
                newest = self.store.newest
                if newest is not None and (request.have is None or newest > request.have):
                    retained = self.store.pin(newest)
                    if retained is not None:
                        break
                await self.changed().wait()
            try:
                digests = await anyio.to_thread.run_sync(retained.digests)
            finally:
                self.store.unpin(retained.version)
            self.pulled[channel.peer] = retained.version
            heads = [
                m.BucketHead(bucket.used, digest, bucket.specs)
                for bucket, digest in zip(retained.buckets, digests, strict=True)
            ]
            return m.Head(retained.version, heads)
        return m.Refused(f"no version newer than {request.have} within {request.timeout:g}s")

    async def get(self, channel: PartsChannel, request: m.Get, timeout: float) -> m.Reply | None:
        """Send one range of a bucket of the pulled version as a chunk (None: sent)."""
        version, index = request.version, request.bucket
        if self.pulled.get(channel.peer) != version:
            return m.Refused(f"version {version} is not pulled on this channel")
        retained = self.store.pin(version)
        if retained is None:
            return m.Refused(f"version {version} is no longer retained")
        try:
            if not 0 <= index < len(retained.buckets):
                return m.Refused(f"no bucket {index} in version {version}")
            bucket = retained.buckets[index]
            start, nbytes = request.offset, request.nbytes
            if not (
                start >= 0 and 0 < nbytes <= m.MAX_CHUNK_BYTES and start + nbytes <= bucket.used
            ):
                return m.Refused(
                    f"bytes [{start}, {start + nbytes}) of bucket {index} of version {version} "
                    f"({bucket.used} bytes; at most {m.MAX_CHUNK_BYTES} per get)"
                )
            data = bucket.segment.tensor.numpy().data[start : start + nbytes]
            header = m.encode(m.Chunk(version, index, start, nbytes))
            with bounded(timeout, "room to send a chunk", channel.peer):
                sent = await channel.send_parts([header, data])
            self.bytes_sent += nbytes
        finally:
            self.store.unpin(version)
        await self._written(channel.peer, sent, timeout)
        return None

    async def _written(self, peer: str, sent: Delivery, timeout: float) -> None:
        """Keep ``sent``; wait until at most :data:`QUEUED_CHUNKS` others are still queued."""
        queue = self.queued.setdefault(peer, collections.deque())
        queue.append(sent)
        with bounded(timeout, "the relay to read its chunks", peer):
            while queue and (queue[0].done or len(queue) > QUEUED_CHUNKS + 1):
                if queue[0].done:
                    queue.popleft()
                else:
                    await anyio.sleep(POLL)
