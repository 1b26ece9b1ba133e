"""Retained versions in shared host memory, and the sink that fills them from publishers.

The server receives a publisher's version through an ordinary
:class:`~aiosync.engine.receiver.WeightReceiver` whose sink is a :class:`RetainingSink`:
each bucket is copied once into a segment of its own (a sealed memfd where the machine
makes them, as a trainer's plane does), with its specs. On commit the version becomes a
:class:`RetainedVersion`: the segments, the manifest rebuilt from the specs, and each
bucket's slots, from which the server streams it to subscribers exactly as a trainer
would, with the segments as the data plane (a subscriber maps them; no copy on the
server). :class:`RetentionStore` keeps them under a
:class:`~aiosync.server.retention.RetentionPolicy`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from aiosync.core.errors import AiosyncError, UsageError
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import Expectations, TensorMeta
from aiosync.core.wire import ShmPlaneSpec, Slot
from aiosync.engine.held import bucket_digest
from aiosync.engine.sink_base import WeightSink
from aiosync.planes.base import StoredPlan
from aiosync.planes.memfd import BACKEND_ENV, memfd_available
from aiosync.planes.shm import ShmSegment
from aiosync.server.retention import RetentionBook, RetentionPolicy

log = logging.getLogger(__name__)


@dataclass
class RetainedBucket:
    """One bucket as the publisher sent it: its segment, bytes used and specs.

    Once its version is indexed (:func:`index_version`): each spec's manifest ``entries``
    and ``slots``, the ``whole`` tensors that end in it and the tensor bytes (``payload``).
    """

    segment: ShmSegment
    used: int
    specs: list[TensorSpec]
    slots: list[Slot] = field(default_factory=list)
    digest: bytes | None = None  # of its content (SHA-256), once a relay or resumer asked
    entries: list[int] = field(default_factory=list)
    whole: int = 0
    payload: int = 0


@dataclass
class RetainedVersion:
    """A whole committed version in shared memory, ready to stream to any subscriber."""

    version: int
    buckets: list[RetainedBucket]
    manifest: list[TensorMeta]
    tensors: int  # whole tensors (what a ``complete`` counts)
    nbytes: int

    def digests(self) -> list[bytes]:
        """Each bucket's content digest (SHA-256), computed once (a worker thread).

        Buckets are hashed in parallel, one thread per core (hashing releases the GIL).
        """
        missing = [bucket for bucket in self.buckets if bucket.digest is None]
        if missing:
            with ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
                found = pool.map(lambda b: bucket_digest(b.segment.tensor[: b.used]), missing)
                for bucket, digest in zip(missing, found, strict=True):
                    bucket.digest = digest
        return [bucket.digest or b"" for bucket in self.buckets]

    def plans(self, digests: list[bytes] | None, held: frozenset[bytes]) -> list[StoredPlan]:
        """Each bucket as a plan stored in buffer ``i`` (the ``i``-th segment of :attr:`spec`).

        ``digests`` (one per bucket, or None) name each by content, those in ``held`` marked
        held. Bounded work per bucket: the lists are the indexed bucket's own.
        """
        named: list[bytes | None] = [*digests] if digests else [None] * len(self.buckets)
        return [
            StoredPlan(
                specs=b.specs,
                used=b.used,
                entries=b.entries,
                whole=b.whole,
                payload=b.payload,
                slots=b.slots,
                buffer=index,
                digest=digest,
                held=digest is not None and digest in held,
            )
            for index, (b, digest) in enumerate(zip(self.buckets, named, strict=True))
        ]

    @property
    def spec(self) -> ShmPlaneSpec:
        """The data plane a subscriber opens: one segment per bucket."""
        return ShmPlaneSpec([bucket.segment.handle for bucket in self.buckets])

    def close(self) -> None:
        """Release the segments (mappings subscribers still hold stay valid)."""
        for bucket in self.buckets:
            bucket.segment.close()


def index_version(version: int, buckets: list[RetainedBucket]) -> RetainedVersion:
    """Rebuild the manifest from the buckets' specs and give each bucket its slots (pure)."""
    entries: dict[str, int] = {}
    metas: list[TensorMeta] = []
    chunks: list[int] = []
    tensors = 0
    for bucket in buckets:
        bucket.slots, bucket.entries = [], []
        bucket.whole = bucket.payload = 0
        for spec in bucket.specs:
            entry = entries.get(spec.name)
            if entry is None:
                entry = entries[spec.name] = len(metas)
                metas.append(TensorMeta(spec.name, spec.dtype, tuple(spec.shape)))
                chunks.append(0)
            chunks[entry] += 1
            bucket.whole += spec.is_last_chunk
            bucket.payload += spec.nbytes
            bucket.entries.append(entry)
            bucket.slots.append(Slot(entry, spec.offset, spec.nbytes, spec.start))
        tensors += bucket.whole
    manifest = [
        TensorMeta(meta.name, meta.dtype, meta.shape, count)
        for meta, count in zip(metas, chunks, strict=True)
    ]
    nbytes = sum(bucket.used for bucket in buckets)
    return RetainedVersion(version, buckets, manifest, tensors, nbytes)


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
        self._changed = threading.Condition()
        self._closed = False
        self._pool: dict[int, list[ShmSegment]] = {}  # released segments by size
        self._pool_bytes = 0
        self._first_bucket: float | None = None
        self.last_publish_seconds: float | None = None  # first bucket to commit, last version
        self.memory_waits = 0  # buckets that had to wait for a pin to go

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
            segment = self._reuse(used)
        try:
            if segment is None:
                segment = _new_segment(used)
            segment.tensor.copy_(bucket.reshape(-1))
        except BaseException:
            with self._changed:
                self.book.pending -= used
                if segment is not None:
                    self._recycle(segment)
            raise
        with self._changed:
            self._pending.append(RetainedBucket(segment, used, list(specs)))
            if self._first_bucket is None:
                self._first_bucket = time.perf_counter()

    def commit(self, version: int) -> RetainedVersion:
        """The pending version is retained as ``version`` (older ones may leave)."""
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

    def abort(self) -> None:
        """Drop the pending version."""
        with self._changed:
            buckets, self._pending = self._pending, []
            self._first_bucket = None
            self.book.abort()
            for bucket in buckets:
                self._recycle(bucket.segment)
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
            versions, self._versions = list(self._versions.values()), {}
            buckets, self._pending = self._pending, []
            self._changed.notify_all()
            pool = [segment for kept in self._pool.values() for segment in kept]
            self._pool.clear()
            self._pool_bytes = 0
        for retained in versions:
            retained.close()
        for segment in [bucket.segment for bucket in buckets] + pool:
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
