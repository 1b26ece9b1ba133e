"""What an engine has received of one version: pure bookkeeping and checks, no IO.

:class:`StreamState` turns each bucket into the specs to apply (from manifest slots or the
names a bucket carries), checks every byte range against the buffer, the manifest and what
the sink expects, and at the end says whether the version is whole.

A trainer usually sends the same manifest and the same buckets every version. The last
stream that came out whole is kept (:class:`StreamMemory`): a version whose manifest equals
its manifest skips the manifest's checks, and while each bucket equals the one at the same
place in that stream (bytes used and every slot, compared whole; the buffer it lies in may
differ, and must be large enough), its checked specs are taken as they were. The first
difference ends the replay: what was replayed is tracked again and from then on every
bucket is checked as usual. Equal messages pass the same checks, so nothing different is
ever accepted this way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import TensorSpec, dtype_from_name, validate_specs
from aiosync.core.limits import Limits
from aiosync.core.manifest import Expectations, TensorMeta, missing_error
from aiosync.core.where_to_run import on_loop
from aiosync.core.wire import Begin, Bucket, Complete, Message, Slot


def check_manifest_form(manifest: list[TensorMeta], max_name_length: int) -> None:
    """A manifest's own consistency: known dtypes, sane shapes, chunks and names, unique."""
    names: set[str] = set()
    for meta in manifest:
        if len(meta.name) > max_name_length:
            raise ProtocolError(
                f"tensor name of {len(meta.name)} characters", tensor=meta.name[:64]
            )
        try:
            dtype_from_name(meta.dtype)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, tensor=meta.name) from None
        if any(dim < 0 for dim in meta.shape) or meta.chunks < 1:
            raise ProtocolError("negative dimension or chunk count", tensor=meta.name)
        if meta.name in names:
            raise ProtocolError("name listed twice in the manifest", tensor=meta.name)
        names.add(meta.name)


@dataclass(frozen=True)
class _Record:
    """One checked bucket of a stream: what it said and the specs it resolved to."""

    used: int
    slots: list[Slot]
    specs: list[TensorSpec]
    planned: list[int | None]  # pieces the manifest announced, per spec
    totals: list[int]  # whole-tensor bytes, per spec


@dataclass(frozen=True)
class StreamMemory:
    """The last stream with a manifest that came out whole, to replay (see the module)."""

    manifest: list[TensorMeta]
    totals: list[int]  # each manifest entry's bytes
    records: list[_Record]
    tensors: int
    # the last other list found equal, held (its id is not reused): asked again about the
    # same list (a begin's triage, then its stream's opening), no entry is compared again
    _equal: list[list[TensorMeta]] = field(default_factory=list, compare=False, repr=False)

    def same_manifest(self, manifest: list[TensorMeta]) -> bool:
        """Whether ``manifest`` equals this one, entry for entry (a difference: False)."""
        if manifest is self.manifest or (self._equal and manifest is self._equal[0]):
            return True
        if manifest != self.manifest:
            return False
        self._equal[:] = [manifest]
        return True


def open_stream(
    begin: Begin,
    expectations: Expectations | None,
    limits: Limits,
    memory: StreamMemory | None,
) -> StreamState:
    """The stream ``begin`` opens, once its manifest (if any) passed every check.

    A manifest equal to ``memory``'s passed them already (against the same expectations
    and limits): the stream then replays ``memory``. Raises an
    :class:`~aiosync.core.errors.AiosyncError` naming the first tensor that fails.
    """
    manifest = begin.manifest
    if manifest is not None:
        if len(manifest) > limits.max_manifest_tensors:
            limit = limits.max_manifest_tensors
            raise ProtocolError(f"manifest of {len(manifest)} tensors (at most {limit})")
        if memory is not None and memory.same_manifest(manifest):
            return StreamState(begin.version, memory.manifest, expectations, begin.empty, memory)
        check_manifest_form(manifest, limits.max_name_length)
        if expectations is not None:
            expectations.check_manifest(manifest)
    return StreamState(begin.version, manifest, expectations, begin.empty)


def light(message: Message, stream: StreamState | None, memory: StreamMemory | None) -> bool:
    """Whether ``message``'s checks are bounded work now, although it names many tensors.

    A ``begin`` whose manifest equals the remembered one skips its checks (one comparison,
    bounded by :data:`~aiosync.core.where_to_run.LOOP_ENTRIES`); a ``complete`` of a stream
    with a manifest, not left half replayed, compares counts only. Anything else: False
    (the caller decides).
    """
    if isinstance(message, Begin):
        manifest = message.manifest
        if manifest is None or memory is None or not on_loop(entries=len(manifest)):
            return False
        return len(manifest) == len(memory.manifest) and memory.same_manifest(manifest)
    if isinstance(message, Complete):
        return stream is not None and stream.version == message.version and stream.light_complete
    return False


@dataclass
class StreamState:
    """One version in flight from one sender, as far as the engine has taken it.

    ``replay``: the last whole stream of the same manifest (already checked), whose
    buckets this one may repeat.
    """

    version: int
    manifest: list[TensorMeta] | None
    expectations: Expectations | None
    empty: bool = False  # the sender said the version has no tensors
    replay: StreamMemory | None = None
    next_seq: int = 1
    buckets: int = 0
    tensors: int = 0
    done: set[str] = field(default_factory=set)
    partial: dict[str, tuple[TensorSpec, int]] = field(default_factory=dict)  # last, pieces
    records: list[_Record] = field(default_factory=list, repr=False)  # buckets resolved
    _totals: list[int] | None = field(default=None, repr=False)  # manifest entries' sizes
    _replaying: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.replay is not None:
            self._totals = self.replay.totals
            self._replaying = True

    def resolve(self, bucket: Bucket, sizes: list[int]) -> list[TensorSpec]:
        """The specs of ``bucket`` once every check passes; records their bytes as received."""
        if not 0 <= bucket.buffer < len(sizes):
            raise ProtocolError(f"no buffer {bucket.buffer}")
        if self._replaying:
            replayed = self._replayed(bucket, sizes[bucket.buffer])
            if replayed is not None:
                return replayed
        specs, planned, totals = self._specs(bucket)
        totals = validate_specs(specs, bucket.used, sizes[bucket.buffer], totals)
        self._track_bucket(specs, planned, totals)
        if self.manifest is not None:
            record = _Record(bucket.used, bucket.slots, specs, planned, totals)
            self.records.append(record)
        return specs

    def _replayed(self, bucket: Bucket, capacity: int) -> list[TensorSpec] | None:
        """The specs of the remembered bucket that ``bucket`` equals, or None (replay ends)."""
        assert self.replay is not None
        records, known = self.records, self.replay.records
        if len(records) < len(known):
            record = known[len(records)]
            if (
                record.used == bucket.used
                and bucket.used <= capacity  # in whichever buffer it is now
                and not bucket.specs
                and record.slots == bucket.slots
            ):
                records.append(record)
                return record.specs
        self._end_replay()
        return None

    def _end_replay(self) -> None:
        """Stop replaying: track the buckets replayed so far as if checked one by one."""
        if self._replaying:
            self._replaying = False
            for record in self.records:
                self._track_bucket(record.specs, record.planned, record.totals)

    def _track_bucket(
        self, specs: list[TensorSpec], planned: list[int | None], totals: list[int]
    ) -> None:
        in_bucket: set[str] = set()
        for spec, chunks, total in zip(specs, planned, totals, strict=True):
            self._track(spec, chunks, total, in_bucket)

    def memory(self) -> StreamMemory | None:
        """What to replay of this stream (call once it came out whole); None without a manifest."""
        if self.manifest is None or self._totals is None:
            return None
        if self._replaying and self.replay is not None:
            return self.replay  # the same stream again
        return StreamMemory(self.manifest, self._totals, self.records, self.tensors)

    def _specs(self, bucket: Bucket) -> tuple[list[TensorSpec], list[int | None], list[int] | None]:
        """The bucket's specs, the pieces each tensor was announced in, and its sizes.

        Sizes (of each whole tensor) are known ahead only with a manifest, checked at begin.
        """
        manifest = self.manifest
        if manifest is None:
            if bucket.slots:
                raise ProtocolError("bucket refers to a manifest the version does not have")
            if self.expectations is not None:
                for spec in bucket.specs:
                    self.expectations.check(spec)
            return bucket.specs, [None] * len(bucket.specs), None
        if bucket.specs:
            raise ProtocolError("bucket repeats names although the version has a manifest")
        if self._totals is None:
            self._totals = [
                TensorSpec(m.name, m.dtype, m.shape, 0, 0).total_nbytes for m in manifest
            ]
        specs: list[TensorSpec] = []
        planned: list[int | None] = []
        totals: list[int] = []
        for slot in bucket.slots:
            entry = slot.entry
            if not 0 <= entry < len(manifest):
                raise ProtocolError(f"no manifest entry {entry}")
            meta = manifest[entry]
            specs.append(
                TensorSpec(meta.name, meta.dtype, meta.shape, slot.offset, slot.nbytes, slot.start)
            )
            planned.append(meta.chunks)
            totals.append(self._totals[entry])
        return specs, planned, totals

    def _track(
        self, spec: TensorSpec, planned: int | None, total: int, in_bucket: set[str]
    ) -> None:
        """Record one spec's bytes: each tensor once, its chunks in order and of one kind.

        ``total`` is the size of the whole tensor the spec belongs to.
        """
        name = spec.name
        if name in self.done or name in in_bucket:
            raise ProtocolError("tensor sent twice", tensor=name)
        in_bucket.add(name)
        previous, pieces = self.partial.get(name, (None, 0))
        expected = 0 if previous is None else previous.start + previous.nbytes
        if spec.start != expected:
            raise ProtocolError(
                f"chunk starts at byte {spec.start}, expected {expected}", tensor=name
            )
        if previous is not None and (previous.dtype, previous.shape) != (spec.dtype, spec.shape):
            raise ProtocolError("chunks disagree on dtype or shape", tensor=name)
        whole = spec.start == 0 and spec.nbytes == total
        if not whole and self.expectations is not None:
            self.expectations.check_chunked(name)
        if spec.start + spec.nbytes != total:  # not the last piece
            self.partial[name] = (spec, pieces + 1)
            return
        self.partial.pop(name, None)
        self.done.add(name)
        self.tensors += 1
        if planned is not None and planned != pieces + 1:
            raise ProtocolError(
                f"sent in {pieces + 1} pieces, manifest said {planned}", tensor=name
            )

    @property
    def light_complete(self) -> bool:
        """Whether :meth:`check_whole` compares counts only (no walk over the tensors)."""
        if self.manifest is None:
            return self.expectations is None
        replay = self.replay
        return not self._replaying or replay is None or len(self.records) == len(replay.records)

    def check_whole(self, complete: Complete) -> None:
        """Raise unless everything the sender counted arrived and the sink's needs are met.

        With a manifest, coverage was checked on the manifest and every entry arrived once
        (each at most once, and as many as listed): the required names are all there.
        """
        if self._replaying and self.replay is not None:
            if len(self.records) == len(self.replay.records):
                self.tensors = self.replay.tensors  # the whole stream, replayed
            else:
                self._end_replay()
        if self.partial:
            raise ProtocolError("tensor incomplete at commit", tensor=next(iter(self.partial)))
        if (complete.buckets, complete.tensors) != (self.buckets, self.tensors):
            raise ProtocolError(
                f"sender counted {complete.buckets} buckets / {complete.tensors} tensors, "
                f"engine applied {self.buckets} / {self.tensors}"
            )
        if self.tensors == 0 and not self.empty:
            raise ProtocolError("a version with no tensors commits only when begun as empty")
        if self.manifest is not None and self.tensors != len(self.manifest):
            raise ProtocolError(f"{len(self.manifest) - self.tensors} manifest tensors unsent")
        if self.expectations is not None and self.manifest is None:
            missing = self.expectations.missing(self.done)
            if missing:
                raise missing_error(missing)
