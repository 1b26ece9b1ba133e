"""Relays: one server feeding another over the network, bucket bytes and all.

A relay is a :class:`~aiosync.server.server.WeightServer` with an ``upstream``: instead of
(or besides) publishers, it pulls each new version from the upstream server's control
endpoint (``tcp://`` with CURVE keys between machines) and serves its own machine's
engines from its shared memory, so a version crosses the network once per machine.

The data plane is the control channel itself: the upstream answers a ``pull`` with the
version's :class:`~aiosync.server.messages.Head` (each bucket's bytes used, a SHA-256
digest of its content, and its specs), and each ``get`` with the bucket's bytes in
:class:`~aiosync.server.messages.Chunk` messages (one bucket in flight at a time, so the
upstream's queue for a relay holds at most one bucket). Buckets are identified by
content: the relay fetches only those whose digest it has neither retained nor received
in an earlier, interrupted attempt (resumable transfers), and copies the others locally.

The upstream is hostile input, bounded by the same :class:`~aiosync.core.limits.Limits`
as an engine's peers (:mod:`aiosync.server.relay_checks`): a head past them is refused
before anything is allocated, named in :attr:`Relay.last_error`, and that version is
skipped (the relay waits for a newer one); the relay keeps running.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import torch

import aiosync.server.messages as m
from aiosync.channels.base import Channel
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import AiosyncError, ProtocolError, RejectedError, SyncTimeoutError
from aiosync.core.limits import Limits
from aiosync.engine.held import HeldBuckets, bucket_digest
from aiosync.server.relay_checks import check_buckets, check_newer
from aiosync.server.store import RetentionStore

log = logging.getLogger(__name__)

AHEAD = 1
"""Buckets asked for beyond the one being received (the upstream's queue holds at most
this many more buckets for a relay)."""


# --- the upstream side: answering a relay's pull and get --------------------------------


@dataclass
class RelayDesk:
    """A server's answers to relays: the version each relay channel pulled.

    A version is pinned only while one of its buckets is being sent: a relay that goes
    away silently holds nothing, and one whose version was evicted between two buckets is
    refused and pulls again (keeping, by digest, what it already received).
    """

    store: RetentionStore
    changed: Callable[[], anyio.Event]
    pulled: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0  # bucket bytes sent to relays, all channels together

    def release(self, peer: str) -> None:
        """The channel ended: forget what it pulled."""
        self.pulled.pop(peer, None)

    async def pull(self, channel: Channel, request: m.Pull, max_wait: float) -> m.Reply:
        """Wait for a version newer than the relay's; answer with its head."""
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

    async def get(self, channel: Channel, request: m.Get, timeout: float) -> m.Reply | None:
        """Send one bucket of the pulled version in chunks (None: sent), or a refusal."""
        if self.pulled.get(channel.peer) != request.version:
            return m.Refused(f"version {request.version} is not pulled on this channel")
        retained = self.store.pin(request.version)
        if retained is None:
            return m.Refused(f"version {request.version} is no longer retained")
        try:
            if not 0 <= request.bucket < len(retained.buckets):
                return m.Refused(f"no bucket {request.bucket} in version {request.version}")
            bucket = retained.buckets[request.bucket]
            data = bucket.segment.tensor[: bucket.used]
            for offset in range(0, bucket.used, m.CHUNK_BYTES):
                piece = memoryview(data[offset : offset + m.CHUNK_BYTES].numpy().data)
                payload = m.encode(m.Chunk(request.version, request.bucket, offset, piece))
                with _bounded(timeout, "room to send a chunk", channel.peer):
                    await channel.send(payload)
                self.bytes_sent += len(piece)
        finally:
            self.store.unpin(request.version)
        return None


# --- the relay side: pulling into this server's store ------------------------------------


class Relay:
    """Pulls versions from ``upstream`` into ``store``; ``published(version)`` after each.

    Buckets received from an interrupted attempt are kept (a
    :class:`~aiosync.engine.held.HeldBuckets`: host memory, by digest) so that the next
    attempt fetches only what is missing. With ``resume_dir`` they are also written there
    (one file per bucket, named by its digest, checked against it when read back), so a
    relay *process* that was killed and started again fetches only what is missing too;
    the files go once the version is retained.

    ``limits`` bound what the upstream may make the relay hold: a version's buckets,
    bytes and tensors, and each reply's bytes. A version refused for its buckets is
    :attr:`refused` and not pulled again; :attr:`last_error` says why the last attempt
    failed.
    """

    def __init__(
        self,
        upstream: str,
        store: RetentionStore,
        published: Callable[[int], None],
        *,
        auth: ChannelAuth | None = None,
        timeout: float = 60.0,
        resume_dir: str | os.PathLike[str] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.upstream = upstream
        self.limits = Limits() if limits is None else limits
        # buckets of an unfinished pull: the version arriving and the one before
        self.held = HeldBuckets(
            resume_dir, memory=True, max_bytes=2 * self.limits.max_session_bytes
        )
        self.resume_dir = self.held.directory
        self.store = store
        self.published = published
        self.auth = auth
        self.timeout = timeout
        self._spare: dict[int, list[torch.Tensor]] = {}  # receive buffers to reuse, by size
        self.bytes_fetched = 0
        self.bytes_reused = 0
        self.refused: int | None = None  # the newest version refused for its buckets
        self.last_error: Exception | None = None  # why the last attempt failed

    async def run(self, poll: float = 3600.0) -> None:
        """Pull every new version until cancelled; reconnect after a broken attempt."""
        while True:
            try:
                async with self.connect() as channel:
                    while True:
                        await self.pull_once(channel, poll)
            except (AiosyncError, OSError) as exc:
                if isinstance(exc, SyncTimeoutError):
                    continue
                self.last_error = exc
                log.warning("relay from %s broke: %s; reconnecting", self.upstream, exc)
                await anyio.sleep(1.0)

    def connect(self) -> _Owned:
        """A new channel to the upstream's control endpoint (an async context manager)."""
        from aiosync.channels.zmq import ZmqChannel

        return _Owned(ZmqChannel.connect(self.upstream, auth=self.auth))

    async def _ask(self, channel: Channel, request: m.Request, seconds: float) -> m.Reply:
        with _bounded(seconds, f"answer to {type(request).__name__}", self.upstream):
            await channel.send(m.encode(request))
            reply = m.decode_reply(await channel.recv(), self.limits.max_message_bytes)
        if isinstance(reply, m.Refused):
            raise RejectedError(reply.reason, peer=self.upstream)
        if isinstance(reply, m.Closing):
            raise AiosyncError(f"upstream closing: {reply.reason}", peer=self.upstream)
        return reply

    async def pull_once(
        self, channel: Channel, wait: float, *, stop_after: int | None = None
    ) -> int | None:
        """Pull the next newer version whole and retain it; returns it.

        ``stop_after`` (tests) fetches that many buckets over the network and then gives
        up as a broken connection would, keeping them for the next attempt.
        """
        have = self.store.newest
        refused = self.refused
        skip = refused if refused is not None and (have is None or refused > have) else have
        head = await self._ask(channel, m.Pull(skip, wait), wait + self.timeout)
        if not isinstance(head, m.Head):
            raise ProtocolError(f"expected a head, got {type(head).__name__}", peer=self.upstream)
        await self._check(head, skip)
        local = self._local_index()
        held = await anyio.to_thread.run_sync(self._held_of, head, local)
        firsts = {bucket.digest: i for i, bucket in reversed(list(enumerate(head.buckets)))}
        wanted = sorted(  # each missing content once (a repeated bucket is fetched once)
            i for digest, i in firsts.items() if digest not in local and digest not in held
        )
        if stop_after is not None:
            wanted = wanted[:stop_after]
        asked = 0  # the next bucket of ``wanted`` to ask for; at most AHEAD asked, unread
        try:
            for index, bucket in enumerate(head.buckets):
                if bucket.digest in local and await self._copy_local(local[bucket.digest], bucket):
                    continue
                data = self.held.cached(bucket.digest)
                if data is None:
                    if index not in wanted:
                        raise AiosyncError("stopped mid-version (test)", peer=self.upstream)
                    position = wanted.index(index)
                    while asked < len(wanted) and asked <= position + AHEAD:
                        await channel.send(m.encode(m.Get(head.version, wanted[asked])))
                        asked += 1
                    data = await self._receive(channel, head.version, index, bucket)
                    await anyio.to_thread.run_sync(self._keep, head.version, bucket.digest, data)
                else:
                    self.bytes_reused += bucket.used
                await anyio.to_thread.run_sync(self.store.add_bucket, data, bucket.specs)
            retained = await anyio.to_thread.run_sync(self.store.commit, head.version)
        except BaseException:
            self.store.abort()
            raise
        for retained_bucket, bucket in zip(retained.buckets, head.buckets, strict=True):
            retained_bucket.digest = bucket.digest
        self._spare = {}  # its receive buffers: faulting pages in costs more than a copy
        for data in await anyio.to_thread.run_sync(self.held.clear):  # and the saved files
            self._spare.setdefault(data.numel(), []).append(data)
        self.published(head.version)
        return head.version

    async def _check(self, head: m.Head, after: int | None) -> None:
        """Refuse a head past the limits (nothing allocated yet), naming the upstream.

        ``after``: the version asked past (the newest retained, or a newer one refused).
        """
        try:
            check_newer(head.version, after)
            try:
                await anyio.to_thread.run_sync(check_buckets, head, self.limits)
            except ProtocolError:
                self.refused = head.version  # not asked for again: wait for a newer one
                raise
        except ProtocolError as exc:
            raise ProtocolError(
                f"refused the upstream's head: {exc.reason}",
                peer=self.upstream,
                version=exc.version,
                tensor=exc.tensor,
            ) from None

    def _keep(self, version: int, digest: bytes, data: torch.Tensor) -> None:
        """Keep a received (and checked) bucket until the version is retained."""
        if not self.held.put(version, digest, data, checked=True, copy=False):
            raise AiosyncError(f"could not keep bucket {digest.hex()[:16]}", version=version)

    def _held_of(self, head: m.Head, local: dict[bytes, tuple[int, int]]) -> set[bytes]:
        """Digests of ``head`` held from an earlier attempt or process (checked, in memory)."""
        found: set[bytes] = set()
        for bucket in head.buckets:
            digest = bucket.digest
            if digest in local or digest in found:
                continue
            if self.held.take(head.version, digest, bucket.used) is not None:
                found.add(digest)
        return found

    def _local_index(self) -> dict[bytes, tuple[int, int]]:
        """Digest -> (version, bucket) of every retained bucket with a known digest."""
        found: dict[bytes, tuple[int, int]] = {}
        for version in self.store.versions:
            retained = self.store.pin(version)
            if retained is None:
                continue
            try:
                for index, bucket in enumerate(retained.buckets):
                    if bucket.digest is not None:
                        found[bucket.digest] = (version, index)
            finally:
                self.store.unpin(version)
        return found

    async def _copy_local(self, where: tuple[int, int], bucket: m.BucketHead) -> bool:
        """Retain a bucket from one this store already holds; False if that one is gone."""
        version, index = where
        retained = self.store.pin(version)
        if retained is None:
            return False
        try:
            source = retained.buckets[index]
            if source.used != bucket.used:
                return False
            data = source.segment.tensor[: source.used]
            await anyio.to_thread.run_sync(self.store.add_bucket, data, bucket.specs)
        finally:
            self.store.unpin(version)
        self.bytes_reused += bucket.used
        return True

    async def _receive(
        self, channel: Channel, version: int, index: int, bucket: m.BucketHead
    ) -> torch.Tensor:
        """One asked-for bucket's chunks, assembled and checked against its digest."""
        spare = self._spare.get(bucket.used)
        try:
            data = spare.pop() if spare else torch.empty(bucket.used, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as exc:  # torch's allocator says RuntimeError
            raise AiosyncError(
                f"cannot allocate {bucket.used} bytes for bucket {index}: {exc}",
                peer=self.upstream,
                version=version,
            ) from None
        view = data.numpy()
        received = 0
        while received < bucket.used:
            with _bounded(self.timeout, "chunk", self.upstream):
                reply = m.decode_reply(await channel.recv(), self.limits.max_message_bytes)
            if isinstance(reply, m.Refused):
                raise RejectedError(reply.reason, peer=self.upstream)
            if (
                not isinstance(reply, m.Chunk)
                or (reply.version, reply.bucket, reply.offset) != (version, index, received)
                or not 0 < len(reply.data) <= bucket.used - received
            ):
                raise ProtocolError("unexpected chunk", peer=self.upstream, version=version)
            view[received : received + len(reply.data)] = memoryview(reply.data)
            received += len(reply.data)
        self.bytes_fetched += received
        if await anyio.to_thread.run_sync(bucket_digest, data) != bucket.digest:
            raise ProtocolError(f"bucket {index} does not match its digest", version=version)
        return data


@contextmanager
def _bounded(seconds: float, what: str, peer: str) -> Iterator[None]:
    """A wait of at most ``seconds``; past it a :class:`SyncTimeoutError` naming the peer."""
    with anyio.move_on_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        raise SyncTimeoutError(f"no {what} within {seconds:g}s", peer=peer)


class _Owned:
    """A channel closed when its ``async with`` ends."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def __aenter__(self) -> Channel:
        return self.channel

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.channel.aclose()
