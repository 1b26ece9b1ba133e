"""A retained version: its buckets' segments, the manifest rebuilt from them, their digests.

:class:`~aiosync.server.store.RetentionStore` keeps these (and re-exports them): each
bucket is a segment of its own as the publisher (or a relay's upstream) sent it, with its
specs and the slots a subscriber's stream names; a version's manifest is rebuilt from the
specs (:func:`index_version`, pure).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import TensorMeta
from aiosync.core.wire import ShmPlaneSpec, Slot
from aiosync.engine.held import bucket_digest
from aiosync.planes.base import StoredPlan
from aiosync.planes.shm import ShmSegment


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
    hashing: Future[bytes] | None = None  # its digest, being computed since it arrived
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

        Buckets are hashed in parallel, one thread per core (hashing releases the GIL);
        those hashed as they arrived (:meth:`RetentionStore.hash_ahead`) are waited for.
        """
        missing = [b for b in self.buckets if b.digest is None and b.hashing is None]
        if missing:
            with ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
                found = pool.map(lambda b: bucket_digest(b.segment.tensor[: b.used]), missing)
                for bucket, digest in zip(missing, found, strict=True):
                    bucket.digest = digest
        for bucket in self.buckets:
            if bucket.digest is None and bucket.hashing is not None:
                bucket.digest = bucket.hashing.result()
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
