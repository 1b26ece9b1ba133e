"""Retained versions in shared host memory, and the sink that fills them from publishers.

The server receives a publisher's version through an ordinary
:class:`~aiosync.engine.receiver.WeightReceiver` whose sink is a :class:`RetainingSink`:
each bucket is copied once into a segment of its own (a sealed memfd where the machine
makes them, as a trainer's plane does), with its specs. On commit the version becomes a
:class:`RetainedVersion` (:mod:`aiosync.server.retained`): the segments, the manifest
rebuilt from the specs, and each bucket's slots, from which the server streams it to
subscribers exactly as a trainer would, with the segments as the data plane (a subscriber
maps them; no copy on the server). :class:`RetentionStore` keeps them under a
:class:`~aiosync.server.retention.RetentionPolicy`. A relay fills the segments itself
(:meth:`RetentionStore.reserve_segment`, :meth:`RetentionStore.add_segment`): each bucket's
bytes land once, in the segment that is retained.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import torch

from aiosync.core.errors import AiosyncError, UsageError
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations
from aiosync.engine.held import bucket_digest
from aiosync.engine.sink_base import WeightSink
from aiosync.planes.memfd import BACKEND_ENV, memfd_available
from aiosync.planes.shm import ShmSegment
from aiosync.server.retained import RetainedBucket as RetainedBucket
from aiosync.server.retained import RetainedVersion as RetainedVersion
from aiosync.server.retained import index_version as index_version
from aiosync.server.retention import RetentionBook, RetentionPolicy

log = logging.getLogger(__name__)


class RetentionStore:
    """Retained versions by number, their pins, and the version a publisher is sending.

    Thread-safe: the sink fills the pending version from a worker thread, transfers pin
    and unpin from the event loop. A bucket that does not fit under ``max_bytes`` waits
    (at most ``memory_timeout`` seconds) for a pinned version to be released.
    """

    def __init__(self, policy: RetentionPolicy, *, memory_timeout: float = 60.0) -> None:
        self.book = RetentionBook(policy)
        self.memory_timeout = memory_timeout
        self._versions: dict[int, RetainedVersion] = {}
        self._pending: list[RetainedBucket] = []
        self._reserved: list[tuple[ShmSegment, int]] = []  # pending, not placed yet
        self._changed = threading.Condition()
        self._closed = False
        self._pool: dict[int, list[ShmSegment]] = {}  # released segments by size
        self._pool_bytes = 0
        self._first_bucket: float | None = None
        self.last_publish_seconds: float | None = None  # first bucket to commit, last version
        self.memory_waits = 0  # buckets that had to wait for a pin to go
        self._hasher: ThreadPoolExecutor | None = None  # with hash_ahead: digests on arrival

    def hash_ahead(self) -> None:
        """From now on, hash each bucket in a worker thread as soon as it is placed.

        A relay's pull then finds a new version's digests computed while the publisher was
        still sending it, instead of waiting for them all once it asks (what
        :meth:`RetainedVersion.digests` does otherwise). A relay desk turns it on at the
        first pull; a server no relay pulls from never hashes.
        """
        with self._changed:
            if self._hasher is None and not self._closed:
                self._hasher = ThreadPoolExecutor(os.cpu_count() or 1, "aiosync-digest")

    @property
    def versions(self) -> list[int]:
        """Retained versions, oldest first."""
        with self._changed:
            return self.book.versions

    @property
    def newest(self) -> int | None:
        """The newest retained version."""
        with self._changed:
            return self.book.newest

    @property
    def used_bytes(self) -> int:
        """Bytes of retained and pending versions."""
        with self._changed:
            return self.book.used_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of shared memory held now: retained, pending, and kept for reuse."""
        with self._changed:
            return self.book.used_bytes + self._pool_bytes

    def _evict(self, versions: tuple[int, ...]) -> None:
        for version in versions:
            retained = self._versions.pop(version, None)
            if retained is not None:
                log.debug("version %d leaves retention", version)
                for bucket in retained.buckets:
                    self._recycle(bucket.segment)

    def _recycle(self, segment: ShmSegment) -> None:
        """Keep a released segment for the next version's bucket of the same size.

        At most one version's bytes are kept (the newest retained version's size): a
        steady stream of same-shaped versions then reuses memory that is already
        allocated and mapped, instead of reserving, faulting in and unmapping it again.
        """
        newest = self.book.newest
        keep = 0 if newest is None else self.book.bytes_of(newest)
        if self._pool_bytes + segment.size > keep or self._closed:
            segment.close()
            return
        self._pool.setdefault(segment.size, []).append(segment)
        self._pool_bytes += segment.size

    def _reuse(self, size: int) -> ShmSegment | None:
        """A kept segment of exactly ``size`` bytes; under ``max_bytes``, drop kept ones."""
        found = self._pool.get(size)
        segment = found.pop() if found else None
        if segment is not None:
            self._pool_bytes -= size
        limit = self.book.policy.max_bytes
        while limit is not None and self._pool and self.book.used_bytes + self._pool_bytes > limit:
            spare_size, spare = next(iter(self._pool.items()))
            spare.pop().close()
            self._pool_bytes -= spare_size
            if not spare:
                del self._pool[spare_size]
        if found is not None and not found:
            self._pool.pop(size, None)
        return segment

    def add_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Copy one bucket of the pending version into a segment of its own (a worker thread).

        The segment is one a retired version released, when one of this size is kept, or
        a new one.
        """
        used = bucket.numel()
        segment = self.reserve_segment(used)
        try:
            segment.tensor.copy_(bucket.reshape(-1))
        except BaseException:
            self._release(segment, used)
            raise
        self.add_segment(segment, used, specs)

    def reserve_segment(self, used: int, segment: ShmSegment | None = None) -> ShmSegment:
        """Room for ``used`` more bytes of the pending version, and a segment to fill there.

        A worker thread: it waits (at most ``memory_timeout``) for a pinned version to go
        when the bytes do not fit. The segment is a retired version's of that size when one
        is kept, else a new one, or ``segment``: one of ``used`` bytes the caller kept from
        an aborted version (:meth:`abort`'s ``keep``). It belongs to the pending version
        from now on: :meth:`add_segment` places it once filled, :meth:`abort` takes it back.
        """
        if segment is not None and segment.size != used:
            raise UsageError(f"a segment of {segment.size} bytes cannot hold {used}")
        deadline = time.monotonic() + self.memory_timeout
        with self._changed:
            while True:
                if self._closed:
                    raise AiosyncError("server is closing")
                try:
                    room = self.book.reserve(used)
                except UsageError as exc:
                    raise AiosyncError(str(exc)) from None
                self._evict(room.evict)
                if room.fits:
                    break
                self.memory_waits += 1
                left = deadline - time.monotonic()
                if left <= 0 or not self._changed.wait(left):
                    raise AiosyncError(
                        f"no room for {used} more bytes within {self.memory_timeout:g}s: "
                        f"{self.book.used_bytes} bytes held, every older version in flight "
                        "to a subscriber"
                    )
            if segment is None:
                segment = self._reuse(used)
        try:
            if segment is None:
                segment = _new_segment(used)
        except BaseException:
            with self._changed:
                self.book.pending -= used
            raise
        with self._changed:
            self._reserved.append((segment, used))
        return segment

    def add_segment(
        self,
        segment: ShmSegment,
        used: int,
        specs: list[TensorSpec],
        digest: bytes | None = None,
    ) -> None:
        """Place a segment from :meth:`reserve_segment`, filled, as the next bucket (no copy).

        ``digest``: its content's, when the caller checked it (a relay); else, with
        :meth:`hash_ahead`, it is computed from now on in a worker thread.
        """
        bucket = RetainedBucket(segment, used, list(specs), digest=digest)
        with self._changed:
            if digest is None and self._hasher is not None:
                bucket.hashing = self._hasher.submit(bucket_digest, segment.tensor[:used])
            self._reserved = [(s, n) for s, n in self._reserved if s is not segment]
            self._pending.append(bucket)
            if self._first_bucket is None:
                self._first_bucket = time.perf_counter()

    def _release(self, segment: ShmSegment, used: int) -> None:
        """A reserved segment that will not be placed: its bytes are free, it is kept for reuse."""
        with self._changed:
            self._reserved = [(s, n) for s, n in self._reserved if s is not segment]
            self.book.pending -= used
            self._recycle(segment)

    def commit(self, version: int) -> RetainedVersion:
        """The pending version is retained as ``version`` (older ones may leave).

        Segments reserved and never placed are released first.
        """
        for segment, used in list(self._reserved):
            self._release(segment, used)
        with self._changed:
            buckets, self._pending = self._pending, []
            first, self._first_bucket = self._first_bucket, None
        retained = index_version(version, buckets)
        if first is not None:
            self.last_publish_seconds = time.perf_counter() - first
        with self._changed:
            self._versions[version] = retained
            self._evict(self.book.commit(version))
            self._changed.notify_all()
        return retained

    def abort(self, keep: Collection[ShmSegment] = ()) -> None:
        """Drop the pending version; its segments are kept for reuse, except those in ``keep``.

        Those (reserved or placed) are left to the caller, to fill the next attempt at a
        version from (:meth:`reserve_segment`) or to close.
        """
        kept = {id(segment) for segment in keep}
        with self._changed:
            buckets, self._pending = self._pending, []
            reserved, self._reserved = self._reserved, []
            self._first_bucket = None
            self.book.abort()
            for segment in [bucket.segment for bucket in buckets] + [s for s, _ in reserved]:
                if id(segment) not in kept:
                    self._recycle(segment)
            self._changed.notify_all()

    def pin(self, version: int) -> RetainedVersion | None:
        """Hold a retained version for a transfer (None if it is no longer retained)."""
        with self._changed:
            if not self.book.pin(version):
                return None
            return self._versions[version]

    def unpin(self, version: int) -> None:
        """Release a transfer's hold."""
        with self._changed:
            self._evict(self.book.unpin(version))
            self._changed.notify_all()

    def close(self) -> None:
        """Release every segment (pending ones too); waiting buckets fail."""
        with self._changed:
            self._closed = True
            hasher, self._hasher = self._hasher, None
            versions, self._versions = list(self._versions.values()), {}
            buckets, self._pending = self._pending, []
            reserved, self._reserved = self._reserved, []
            self._changed.notify_all()
            pool = [segment for kept in self._pool.values() for segment in kept]
            self._pool.clear()
            self._pool_bytes = 0
        if hasher is not None:
            hasher.shutdown(wait=False, cancel_futures=True)
        for retained in versions:
            retained.close()
        for segment in [bucket.segment for bucket in buckets] + [s for s, _ in reserved] + pool:
            segment.close()


def _new_segment(size: int) -> ShmSegment:
    """A sealed memfd (a file in ``/dev/shm`` where memfds cannot be made or are refused).

    A memfd is also sealed against writes (where the kernel can): only the server's own
    view, through which it fills and refills the segment, can change it; subscribers map
    it read-only.
    """
    if memfd_available() and os.environ.get(BACKEND_ENV, "").strip().lower() != "file":
        return ShmSegment.create(size, backend="memfd", seal_writes=True)
    return ShmSegment.create(size, backend="file")


class RetainingSink(WeightSink):
    """A :class:`~aiosync.engine.sinks.WeightSink` that retains every version it is sent.

    Staged (nothing is visible before commit) and without expectations: the server takes
    any well-formed version; its subscribers check it against their own models.
    """

    def __init__(self, store: RetentionStore) -> None:
        self.store = store

    @property
    def device(self) -> torch.device:
        """Host memory."""
        return torch.device("cpu")

    @property
    def staged(self) -> bool:
        """True: a version is retained only on commit."""
        return True

    def expectations(self) -> Expectations | None:
        """None: any well-formed version."""
        return None

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Copy the bucket into shared memory."""
        self.store.add_bucket(bucket, specs)

    def commit(self, version: int) -> None:
        """Retain the version."""
        self.store.commit(version)

    def abort(self) -> None:
        """Drop what was received of the version."""
        self.store.abort()
