"""The engine's side of a colocated sync: parts from several trainer ranks into its sinks.

An engine spanning ``n`` GPUs has one sink per GPU (its tensor-parallel ranks); trainer rank
``offset + i`` shares GPU ``i`` with it and hands sink ``i`` its part of every bucket. A
:class:`ColocatedReceiver` is called as SGLang's engines are
(``update_weights_from_tensor(serialized_named_tensors, load_format, flush_cache,
weight_version)``, through any :class:`~aiosync.handles.EngineHandle`), once per bucket with
one encoded :class:`~aiosync.core.colocated_parts.RankPart` per GPU, then twice with parts
marked ``last`` and no bytes: first to prepare (the version covered what every sink
requires; nothing visible changes), then, once every engine of the fleet prepared, to
commit (the prepared version becomes current). Every part is hostile input: decoded, its
specs checked against the sink's expectations before any byte is copied, its buffer opened
through :mod:`aiosync.planes` (sealed memfds on the CPU, CUDA IPC handles on a GPU) and closed
again when the version ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from aiosync.core.answers import WeightSyncResult
from aiosync.core.colocated_parts import FORMAT, RankPart, decode_part
from aiosync.core.errors import AiosyncError, ProtocolError, UsageError
from aiosync.core.limits import Limits
from aiosync.core.manifest import Expectations
from aiosync.core.wire import CudaPlaneSpec, CudaRegion, PlaneSpec, ShmHandle, ShmPlaneSpec
from aiosync.engine.sinks import WeightSink
from aiosync.planes import ReceiverPlane, open_receiver_plane

log = logging.getLogger(__name__)

OPEN_PER_GPU = 2
"""Buffers of one trainer rank kept open during a version (its packing ring)."""


def _one_buffer(handle: ShmHandle | CudaRegion, device: torch.device) -> PlaneSpec:
    """The plane of the one buffer a part names; a CUDA one opens on ``device``'s GPU.

    It has no events: the trainer's packing was done before the part was sent.
    """
    if isinstance(handle, ShmHandle):
        return ShmPlaneSpec([handle])
    index = device.index if device.type == "cuda" and device.index is not None else None
    gpu = torch.cuda.current_device() if index is None else index
    return CudaPlaneSpec(device=gpu, size=handle.size, handles=[handle.handle])


class _Opened:
    """One GPU's open buffer: the handle it was opened from and the plane holding it."""

    def __init__(self, handle: ShmHandle | CudaRegion, plane: ReceiverPlane) -> None:
        self.handle = handle
        self.plane = plane


class ColocatedReceiver:
    """Applies colocated trainer ranks' bucket parts to one sink per engine GPU.

    ``sinks[i]`` takes the part of the ``i``-th trainer rank of the engine's range. Calls
    return a :class:`~aiosync.handles.WeightSyncResult` and never raise for a peer's
    fault: a refused part fails the call with text naming the rank and tensor, aborts the
    version on every sink (a staged sink is left as it was) and closes what was opened.
    ``weight_version`` (a string of an integer, as SGLang passes it) names the version;
    None moves to the engine's next one (0 first). ``limits`` bound what a part may name.
    """

    def __init__(
        self, sinks: Sequence[WeightSink], *, name: str = "engine", limits: Limits | None = None
    ) -> None:
        if not sinks:
            raise UsageError("a colocated receiver needs at least one sink")
        self.name = name
        self._sinks = list(sinks)
        self._limits = limits or Limits()
        self._expectations: list[Expectations | None] = [s.expectations() for s in self._sinks]
        self._opened: dict[int, list[_Opened]] = {}  # per GPU, newest last
        self._covered: list[set[str]] = [set() for _ in self._sinks]
        self._seq = 0
        self._prepared: int | None = None
        self._touched = False  # an in-place sink holds bytes of an uncommitted version
        self._lock = threading.Lock()
        self._pool = (
            ThreadPoolExecutor(len(self._sinks), thread_name_prefix=f"aiosync-{name}")
            if len(self._sinks) > 1
            else None
        )
        self.current_version: int | None = None
        """The version last made current (None before the first)."""
        self.failures: list[str] = []
        """Why calls failed, oldest first."""

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> WeightSyncResult:
        """Apply one bucket's parts (or, for parts marked last, commit the version)."""
        if not self._lock.acquire(blocking=False):
            return WeightSyncResult(False, f"{self.name}: another update is in progress")
        try:
            return self._update(serialized_named_tensors, load_format, weight_version)
        except Exception as exc:  # a peer's fault or the sink's: an answer, never a raise
            text = f"{self.name}: {exc}"
            self.failures.append(text)
            del self.failures[: -self._limits.max_failures]
            log.warning("%s", text)
            self._abort()
            return WeightSyncResult(False, text)
        finally:
            self._lock.release()

    def _update(
        self, entries: Sequence[bytes | str], load_format: str | None, weight_version: str | None
    ) -> WeightSyncResult:
        if load_format != FORMAT:
            raise ProtocolError(f"load_format {load_format!r} is not {FORMAT!r}")
        if len(entries) != len(self._sinks):
            raise ProtocolError(f"{len(entries)} parts for an engine of {len(self._sinks)} GPUs")
        parts = [self._decode(entry) for entry in entries]
        version = self._version(weight_version)
        if len({(part.last, part.commit) for part in parts}) != 1:
            raise ProtocolError("some parts end the version (or commit it) and others do not")
        if parts[0].seq == 0 and self._seq != 0:  # a new sync: an unfinished one is dropped
            log.warning("%s: a new sync began before the last one ended; dropping it", self.name)
            self._abort()
        first = parts[0]
        for i, part in enumerate(parts):
            if part.engine != first.engine or part.rank != first.rank + i:
                raise ProtocolError(
                    f"part {i} comes from rank {part.rank} for engine {part.engine}; expected "
                    f"rank {first.rank + i} for engine {first.engine}"
                )
        for part in parts:
            if part.error is not None:
                raise AiosyncError(f"trainer rank {part.rank}: {part.error}", version=version)
            if part.seq != self._seq:
                raise ProtocolError(
                    f"rank {part.rank} sent bucket {part.seq}, expected {self._seq}"
                )
        if parts[0].commit:
            return self._commit(version)
        if parts[0].last:
            return self._prepare(version)
        if self._prepared is not None:
            raise ProtocolError(f"a bucket after version {self._prepared} was prepared")
        for index, part in enumerate(parts):  # every part checked before any byte moves
            self._check(index, part)
        if self._pool is None:
            self._apply(0, parts[0])
        else:  # one thread per GPU, as an engine's tensor-parallel workers would apply
            futures = [self._pool.submit(self._apply, i, part) for i, part in enumerate(parts)]
            wait(futures)  # all of them, so none still writes when a failure aborts the sinks
            for future in futures:
                future.result()
        self._seq += 1
        return WeightSyncResult(True, f"{self.name}: bucket {self._seq - 1} of version {version}")

    def _decode(self, entry: bytes | str) -> RankPart:
        if isinstance(entry, str):
            raise ProtocolError("a part must be bytes (msgpack), not str")
        return decode_part(entry)

    def _version(self, weight_version: str | None) -> int:
        if weight_version is None:
            return 0 if self.current_version is None else self.current_version + 1
        try:
            return int(weight_version)
        except (TypeError, ValueError):
            raise ProtocolError(f"weight_version {weight_version!r} is not an integer") from None

    def _plane(self, index: int, part: RankPart) -> ReceiverPlane:
        """The open buffer ``part`` names, kept open for the version.

        At most :data:`OPEN_PER_GPU` per GPU (a trainer packs the next bucket into a second).
        """
        handle = part.buffer
        if handle is None:
            raise ProtocolError(f"rank {part.rank} names no buffer for bucket {part.seq}")
        opened = self._opened.setdefault(index, [])
        for held in opened:
            if held.handle == handle:
                return held.plane
        while len(opened) >= OPEN_PER_GPU:  # the oldest is one the trainer replaced
            opened.pop(0).plane.close()
        sink = self._sinks[index]
        plane = open_receiver_plane(_one_buffer(handle, sink.device), sink.device, self._limits)
        opened.append(_Opened(handle, plane))
        return plane

    def _check(self, index: int, part: RankPart) -> None:
        if part.used > self._limits.max_session_bytes:
            raise ProtocolError(
                f"rank {part.rank}: a bucket of {part.used} bytes is over the limit"
            )
        if len(part.specs) > self._limits.max_bucket_tensors:
            raise ProtocolError(f"rank {part.rank}: {len(part.specs)} tensors in one bucket")
        expectations = self._expectations[index]
        for spec in part.specs:
            if expectations is not None:
                expectations.check(spec)
                if not spec.is_whole:
                    expectations.check_chunked(spec.name)
            if spec.is_last_chunk:
                self._covered[index].add(spec.name)

    def _apply(self, index: int, part: RankPart) -> None:
        plane = self._plane(index, part)
        if not self._sinks[index].staged:
            self._touched = True
        view = plane.view(0, part.used)
        try:
            self._sinks[index].apply_bucket(view, part.specs)
        finally:
            del view

    def _prepare(self, version: int) -> WeightSyncResult:
        for index, expectations in enumerate(self._expectations):
            if expectations is None:
                continue
            missing = expectations.missing(self._covered[index])
            if missing:
                shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise AiosyncError(f"GPU {index}: version misses {len(missing)} tensors: {shown}")
        self._prepared = version
        self._seq += 1
        return WeightSyncResult(True, f"{self.name}: version {version} prepared")

    def _commit(self, version: int) -> WeightSyncResult:
        if self._prepared != version:
            raise ProtocolError(f"commit of version {version}, but {self._prepared} is prepared")
        for sink in self._sinks:
            sink.commit(version)
        self.current_version = version
        self._touched = False
        buckets = self._seq - 1
        self._reset()
        return WeightSyncResult(True, f"{self.name}: version {version} current ({buckets} buckets)")

    @property
    def servable(self) -> bool:
        """False while in-place sinks hold part of an unfinished or failed version."""
        return not self._touched

    def _reset(self) -> None:
        for opened in self._opened.values():
            for held in opened:
                held.plane.close()
        self._opened.clear()
        self._covered = [set() for _ in self._sinks]
        self._seq = 0
        self._prepared = None

    def _abort(self) -> None:
        for sink in self._sinks:
            try:
                sink.abort()
            except Exception as exc:  # the original failure is what the caller needs
                log.warning("%s: aborting a sink failed: %r", self.name, exc)
        self._reset()

    def close(self) -> None:
        """Close every buffer still open and forget a version in progress (idempotent)."""
        with self._lock:
            self._abort()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
