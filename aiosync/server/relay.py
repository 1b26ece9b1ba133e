"""Relays: one server feeding another over the network, bucket bytes and all.

A relay is a :class:`~aiosync.server.server.WeightServer` with an ``upstream``: instead of
(or besides) publishers, it pulls each new version from the upstream server's control
endpoint (``tcp://`` with CURVE keys between machines) and serves its own machine's
engines from its shared memory, so a version crosses the network once per machine.

The data plane is the control channel itself: the upstream answers a ``pull`` with the
version's :class:`~aiosync.server.messages.Head` (each bucket's bytes used, a SHA-256
digest of its content, and its specs; :mod:`aiosync.server.relay_desk`), and each ``get``
of a range with one :class:`~aiosync.server.messages.Chunk` whose bytes travel as a second
message part, from the upstream's segment to the relay's without a copy into or out of a
message (:mod:`aiosync.server.relay_fetch`: several chunks in flight, each copied once
into the segment the store retains and hashed there in worker threads). Buckets are
identified by content: the relay fetches only those whose digest it has neither retained
nor received in an earlier, interrupted attempt (resumable transfers), and copies the
others locally; what it received of an attempt that failed stays in its segments for the
next one.

The upstream is hostile input, bounded by the same :class:`~aiosync.core.limits.Limits`
as an engine's peers (:mod:`aiosync.server.relay_checks`): a head past them is refused
before anything is allocated, named in :attr:`Relay.last_error`, and that version is
skipped (the relay waits for a newer one); the relay keeps running. No frame larger than
``max_message_bytes`` is buffered, and every bucket is checked against its digest before
it is retained.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import anyio
import torch

import aiosync.server.messages as m
from aiosync.channels.base import PartsChannel
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import (
    AiosyncError,
    PeerGoneError,
    ProtocolError,
    RejectedError,
    SyncTimeoutError,
)
from aiosync.core.limits import Limits
from aiosync.engine.held import HeldBuckets
from aiosync.planes.shm import ShmSegment
from aiosync.server.relay_checks import check_buckets, check_newer
from aiosync.server.relay_desk import RelayDesk as RelayDesk
from aiosync.server.relay_fetch import BucketFill, Window, bounded, fetch, gone
from aiosync.server.store import RetentionStore

log = logging.getLogger(__name__)

FRAME_SLACK = 1 << 10
"""Bytes a frame may have past ``max_message_bytes`` on the wire (CURVE's box around it)."""


@dataclass(frozen=True)
class PullTimes:
    """Seconds from a pull's start: to the head, to the last bucket fetched, to retained."""

    head: float
    fetched: float
    retained: float


# --- the relay side: pulling into this server's store ------------------------------------


class Relay:
    """Pulls versions from ``upstream`` into ``store``; ``published(version)`` after each.

    Buckets received in an attempt that failed are kept (a
    :class:`~aiosync.engine.held.HeldBuckets` by digest, in the segments they were received
    into, which the store's abort leaves to the relay) so that the next attempt fetches
    only what is missing and reuses them as they are. With ``resume_dir`` they are also
    written there (one file per bucket, named by its digest, checked against it when read
    back), so a relay *process* that was killed and started again fetches only what is
    missing too; the files go once the version is retained.

    ``limits`` bound what the upstream may make the relay hold: a version's buckets,
    bytes and tensors, and each frame's bytes. A version refused for its buckets is
    :attr:`refused` and not pulled again; :attr:`last_error` says why the last attempt
    failed; :attr:`last_pull` how long the last pull that retained a version took.
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
        most = self.limits.max_message_bytes
        self.window = Window(chunk=min(m.CHUNK_BYTES, most), timeout=timeout, max_frame=most)
        self._segments: dict[bytes, ShmSegment] = {}  # what held's memory entries live in
        self._counting = threading.Lock()
        self.bytes_fetched = 0  # bucket bytes received that matched their digest
        self.bytes_reused = 0  # bucket bytes this relay held already (kept, retained, repeated)
        self.refused: int | None = None  # the newest version refused for its buckets
        self.last_error: Exception | None = None  # why the last attempt failed
        self.last_pull: PullTimes | None = None

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
        """A new channel to the upstream's control endpoint (an async context manager).

        Its socket takes no frame over ``limits.max_message_bytes`` (and CURVE's few bytes
        around it): libzmq drops the connection instead of buffering such a frame.
        """
        from aiosync.channels.zmq import ZmqChannel

        most = self.limits.max_message_bytes + FRAME_SLACK
        return _Owned(ZmqChannel.connect(self.upstream, auth=self.auth, max_message_bytes=most))

    async def _ask(self, channel: PartsChannel, request: m.Request, seconds: float) -> m.Reply:
        what = f"the answer to {type(request).__name__.lower()}"
        try:
            with bounded(seconds, what, self.upstream):
                await channel.send(m.encode(request))
                parts = await channel.recv_parts()
        except PeerGoneError as exc:
            raise gone(exc, what, self.limits.max_message_bytes, None) from None
        reply = m.decode_reply(parts[0], self.limits.max_message_bytes)
        if isinstance(reply, m.Refused):
            raise RejectedError(reply.reason, peer=self.upstream)
        if isinstance(reply, m.Closing):
            raise AiosyncError(f"upstream closing: {reply.reason}", peer=self.upstream)
        return reply

    async def pull_once(
        self, channel: PartsChannel, wait: float, *, stop_after: int | None = None
    ) -> int | None:
        """Pull the next newer version whole and retain it; returns it.

        ``stop_after`` (tests) fetches that many buckets over the network and then gives
        up as a broken connection would, keeping them for the next attempt.
        """
        have = self.store.newest
        refused = self.refused
        skip = refused if refused is not None and (have is None or refused > have) else have
        asked = time.perf_counter()
        head = await self._ask(channel, m.Pull(skip, wait), wait + self.timeout)
        headed = time.perf_counter()
        if not isinstance(head, m.Head):
            raise ProtocolError(f"expected a head, got {type(head).__name__}", peer=self.upstream)
        await self._check(head, skip)
        version = head.version
        ready: dict[int, ShmSegment] = {}  # each bucket's segment, filled
        try:
            local = self._local_index()
            missing = await anyio.to_thread.run_sync(self._from_here, head, local, ready)
            if stop_after is not None:
                missing = missing[:stop_after]
            fills = [BucketFill(i, head.buckets[i], self.store.reserve_segment) for i in missing]
            whole = partial(self._whole, version)
            await fetch(channel, version, fills, self.window, whole=whole, upstream=self.upstream)
            fetched = time.perf_counter()
            ready.update((fill.index, fill.segment) for fill in fills if fill.segment is not None)
            await anyio.to_thread.run_sync(self._assemble, head, ready)
            await anyio.to_thread.run_sync(self.store.commit, version)
        except BaseException:
            self.store.abort(keep=list(self._segments.values()))
            self._prune()
            raise
        await anyio.to_thread.run_sync(self.held.clear)  # and the saved files
        owned = {id(segment) for segment in ready.values()}
        for segment in self._segments.values():  # kept for a version that never came
            if id(segment) not in owned:
                segment.close()
        self._segments = {}
        now = time.perf_counter()
        self.last_pull = PullTimes(headed - asked, fetched - asked, now - asked)
        self.published(version)
        return version

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

    # --- a worker thread: what this relay holds already, and the version's order -------

    def _from_here(
        self, head: m.Head, local: dict[bytes, tuple[int, int]], ready: dict[int, ShmSegment]
    ) -> list[int]:
        """Fill ``ready`` from what this relay holds; the buckets left to fetch, in order.

        Each content once: the first bucket of each digest (a repeat is copied from it).
        A bucket received in an earlier attempt is used in its own segment; one retained
        here, or held in a file, is copied into a new one.
        """
        missing: list[int] = []
        seen: set[bytes] = set()
        for index, bucket in enumerate(head.buckets):
            digest = bucket.digest
            if digest in seen:
                continue
            seen.add(digest)
            data = self.held.take(head.version, digest, bucket.used)
            kept = self._segments.get(digest)
            if data is not None and kept is not None and _backs(kept, data):
                ready[index] = self.store.reserve_segment(bucket.used, segment=kept)
            elif digest in local and self._copy_local(local[digest], bucket, ready, index):
                pass
            elif data is not None:
                ready[index] = self._copied(data, bucket.used)
            else:
                missing.append(index)
                continue
            self._count(reused=bucket.used)
        return missing

    def _assemble(self, head: m.Head, ready: dict[int, ShmSegment]) -> None:
        """Place every bucket in the version's order; a repeat is copied from its first."""
        firsts: dict[bytes, int] = {}
        for index, bucket in enumerate(head.buckets):
            first = firsts.setdefault(bucket.digest, index)
            segment = ready.get(index)
            if segment is None:
                source = ready.get(first)
                if source is None or first == index:
                    raise AiosyncError("stopped mid-version (test)", peer=self.upstream)
                segment = ready[index] = self._copied(source.tensor[: bucket.used], bucket.used)
                self._count(reused=bucket.used)
            self.store.add_segment(segment, bucket.used, bucket.specs, bucket.digest)

    def _copied(self, data: torch.Tensor, used: int) -> ShmSegment:
        segment = self.store.reserve_segment(used)
        segment.tensor.copy_(data.reshape(-1)[:used])
        return segment

    def _whole(self, version: int, fill: BucketFill) -> None:
        """A fetched bucket matched its digest (its lane): keep it, for a failed attempt's next."""
        segment, bucket = fill.segment, fill.bucket
        assert segment is not None
        self._count(fetched=bucket.used)
        data = segment.tensor[: bucket.used]
        if self.held.put(version, bucket.digest, data, checked=True, copy=False):
            with self._counting:
                self._segments[bucket.digest] = segment

    def _count(self, *, fetched: int = 0, reused: int = 0) -> None:
        with self._counting:
            self.bytes_fetched += fetched
            self.bytes_reused += reused

    def _prune(self) -> None:
        """Forget (and close) kept segments whose bucket the held store no longer keeps."""
        for digest, segment in list(self._segments.items()):
            data = self.held.cached(digest)
            if data is None or not _backs(segment, data):
                del self._segments[digest]
                segment.close()

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

    def _copy_local(
        self,
        where: tuple[int, int],
        bucket: m.BucketHead,
        ready: dict[int, ShmSegment],
        index: int,
    ) -> bool:
        """Copy a bucket this store retains into ``ready[index]``; False if that one is gone."""
        version, source_index = where
        retained = self.store.pin(version)
        if retained is None:
            return False
        try:
            source = retained.buckets[source_index]
            if source.used != bucket.used:
                return False
            ready[index] = self._copied(source.segment.tensor, bucket.used)
        finally:
            self.store.unpin(version)
        return True


def _backs(segment: ShmSegment, data: torch.Tensor) -> bool:
    """Whether ``data`` is a view of ``segment``'s memory from its start."""
    return data.data_ptr() == segment.tensor.data_ptr()


class _Owned:
    """A channel closed when its ``async with`` ends."""

    def __init__(self, channel: PartsChannel) -> None:
        self.channel = channel

    async def __aenter__(self) -> PartsChannel:
        return self.channel

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.channel.aclose()
