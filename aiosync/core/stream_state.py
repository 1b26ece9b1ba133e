"""What an engine has received of one version: pure bookkeeping and checks, no IO.

:class:`StreamState` turns each bucket into the specs to apply (from manifest slots or the
names a bucket carries), checks every byte range against the buffer, the manifest and what
the sink expects, and at the end says whether the version is whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import TensorSpec, dtype_from_name, validate_specs
from aiosync.core.manifest import Expectations, TensorMeta, missing_error
from aiosync.core.wire import Bucket, Complete


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


@dataclass
class StreamState:
    """One version in flight from one sender, as far as the engine has taken it."""

    version: int
    manifest: list[TensorMeta] | None
    expectations: Expectations | None
    empty: bool = False  # the sender said the version has no tensors
    next_seq: int = 1
    buckets: int = 0
    tensors: int = 0
    done: set[str] = field(default_factory=set)
    partial: dict[str, tuple[TensorSpec, int]] = field(default_factory=dict)  # last, pieces
    _totals: list[int] | None = field(default=None, repr=False)  # manifest entries' sizes

    def resolve(self, bucket: Bucket, sizes: list[int]) -> list[TensorSpec]:
        """The specs of ``bucket`` once every check passes; records their bytes as received."""
        if not 0 <= bucket.buffer < len(sizes):
            raise ProtocolError(f"no buffer {bucket.buffer}")
        specs, planned, totals = self._specs(bucket)
        totals = validate_specs(specs, bucket.used, sizes[bucket.buffer], totals)
        in_bucket: set[str] = set()
        for spec, chunks, total in zip(specs, planned, totals, strict=True):
            self._track(spec, chunks, total, in_bucket)
        return specs

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

    def check_whole(self, complete: Complete) -> None:
        """Raise unless everything the sender counted arrived and the sink's needs are met."""
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
        if self.expectations is not None:
            missing = self.expectations.missing(self.done)
            if missing:
                raise missing_error(missing)
