"""A caller's buckets, one at a time, into a version streaming on another thread.

NeMo-RL's broadcast function iterates its buckets in the caller's thread and holds the
rollout-engine lock around each; the version itself streams on the background event loop
(:func:`aiosync.handles.fleet.send_version`). :class:`CallerBuckets` joins the two: the
caller's :meth:`~CallerBuckets.put` hands over one bucket and returns once every engine
answered it (or the stream ended), so the caller's iterator, its lock and its tensors stay
in its own thread and each bucket is done before the next is read; the stream's packing
thread takes each bucket as a plan from :meth:`~CallerBuckets.plans`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import torch

from aiosync.collectives import Deadline
from aiosync.core.errors import SyncTimeoutError, UsageError
from aiosync.core.layout import BucketPlan
from aiosync.handles.metadata import bucket_layout, describe
from aiosync.pipeline.report import SyncProgress

Pairs = Sequence[tuple[str, torch.Tensor]]


class CallerBuckets:
    """The hand-over of one version's buckets (thread-safe), bounded by ``deadline``."""

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        self._ready = threading.Condition()
        self._next: Pairs | None = None
        self._given = self._answered = 0
        self._closed = False  # no more buckets come
        self._stopped = False  # the stream ended: none is taken any more
        self.abandoned = False  # the caller's side failed (not the engines')

    def put(self, bucket: Pairs) -> bool:
        """Hand over ``bucket``; True once every engine answered it, False if the stream ended."""
        with self._ready:
            if self._stopped:
                return False
            self._next = bucket
            self._given += 1
            self._ready.notify_all()
            self._ready.wait_for(
                lambda: self._stopped or self._answered >= self._given,
                timeout=max(0.0, self._deadline.remaining()),
            )
            return not self._stopped and self._answered >= self._given

    def close(self, *, abandoned: bool = False) -> None:
        """No more buckets: the version ends (``abandoned``: the caller's iterator failed)."""
        with self._ready:
            self._closed = True
            self.abandoned = self.abandoned or abandoned
            self._ready.notify_all()

    def stop(self) -> None:
        """The stream ended or failed: the caller's waits end (any thread)."""
        with self._ready:
            self._stopped = True
            self._ready.notify_all()

    def answered(self, progress: SyncProgress) -> None:
        """The stream's progress: ``progress.buckets`` buckets answered by every engine."""
        with self._ready:
            self._answered = progress.buckets
            self._ready.notify_all()

    def plans(self) -> Iterator[BucketPlan]:
        """Each bucket as a plan laid out as SGLang's engines lay it out (the packing thread)."""
        while True:
            with self._ready:
                self._ready.wait_for(
                    lambda: self._next is not None or self._closed or self._stopped,
                    timeout=max(0.0, self._deadline.remaining()),
                )
                bucket, self._next = self._next, None
                if bucket is None and self.abandoned:
                    raise UsageError("the caller's buckets ended in an error")
                if bucket is None and not (self._closed or self._stopped):
                    raise SyncTimeoutError("no bucket from the caller within the deadline")
            if bucket is None:
                return
            try:
                specs, used = bucket_layout(*describe(bucket), max_bytes=1 << 62)
            except BaseException:
                self.abandoned = True
                raise
            yield BucketPlan([tensor for _, tensor in bucket], specs, used)
