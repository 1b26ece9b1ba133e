"""Pure byte layout: tensor specs, bucket planning, packing into and viewing out of a buffer.

Nothing here does IO. A bucket is a run of tensors (or byte ranges of one tensor, when it is
larger than a buffer) laid out at :data:`ALIGNMENT`-byte offsets in one flat ``uint8`` buffer.
Each :class:`TensorSpec` says where a tensor's bytes lie, so a bucket describes itself.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from aiosync.core.bulk_copy import pack_tiny
from aiosync.core.errors import MismatchError, ProtocolError

ALIGNMENT = 512
"""Byte alignment of every tensor inside a buffer (enough for any dtype and for vector loads)."""

TINY_BYTES = ALIGNMENT
"""Bytes up to which a one-dimensional tensor is packed with others of its dtype in one call
(:func:`~aiosync.core.bulk_copy.pack_tiny`): for such tensors a call per tensor costs many
times the copy."""

_STREAMED = "float64 float32 float16 bfloat16 complex64 complex128 int64 int32 int16 int8 uint8"
_DTYPES: dict[str, torch.dtype] = {  # wire name -> dtype; the wire names are torch's own
    name: getattr(torch, name)
    for name in (*_STREAMED.split(), "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)  # float8: recent torch only
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
"""The wire name of each dtype a layout may carry (``torch.float32 -> "float32"``)."""


def calculate_aligned_size(size_bytes: int, alignment: int = ALIGNMENT) -> int:
    """Round ``size_bytes`` up to the next multiple of ``alignment`` (a positive integer)."""
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    if size_bytes < 0:
        raise ValueError(f"size_bytes must not be negative, got {size_bytes}")
    return -(-size_bytes // alignment) * alignment


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be streamed") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; :class:`ProtocolError` for a name not on the list."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r}") from None


class TensorSpec(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where one tensor's bytes (or one byte range of it) lie inside a buffer.

    ``offset`` is the position in the buffer, ``nbytes`` the bytes stored there and
    ``start`` the position of those bytes inside the whole tensor (0 unless the tensor is
    split across buckets because it is larger than a buffer).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    start: int = 0

    @property
    def total_nbytes(self) -> int:
        """Bytes of the whole tensor this spec belongs to."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_from_name(self.dtype).itemsize

    @property
    def is_whole(self) -> bool:
        """True when this spec carries the entire tensor, not one chunk of it."""
        return self.start == 0 and self.nbytes == self.total_nbytes

    @property
    def is_last_chunk(self) -> bool:
        """True when this spec's bytes end the tensor (always true for a whole tensor)."""
        return self.start + self.nbytes == self.total_nbytes


def materialize(tensor: Any) -> torch.Tensor:
    """Resolve an async collective result (anything with ``.wait()``) to a plain tensor."""
    wait = getattr(tensor, "wait", None)
    if callable(wait):
        tensor = wait()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def iter_named_tensor_buckets(
    params_generator: Iterable[tuple[str, torch.Tensor]],
    buffer_size_bytes: int,
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most ``buffer_size_bytes``.

    A new bucket starts when adding a tensor would go over the limit; a tensor larger than
    the limit travels alone in its own bucket. Async results (``.wait()``) are resolved before
    sizing, so every yielded tensor is materialised.
    """
    if buffer_size_bytes <= 0:
        raise ValueError(f"buffer_size_bytes must be positive, got {buffer_size_bytes}")
    return _iter_buckets(params_generator, buffer_size_bytes)


def _iter_buckets(
    params: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, raw in params:
        tensor = materialize(raw)
        size = tensor.numel() * tensor.element_size()
        if bucket and used + size > limit:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket


@dataclass
class BucketPlan:
    """The tensors of one bucket, their specs (in buffer order) and the buffer bytes used.

    Tensors and specs are kept in two parallel lists rather than as one object per tensor:
    a version of many small tensors then allocates little that the garbage collector must
    scan (specs are not tracked by it), which keeps collections, and the pauses they cause
    on every thread, short. What a planner that knew the manifest adds: ``entries``, each
    spec's manifest entry; ``tiny``, the positions of whole one-dimensional tensors of at
    most :data:`TINY_BYTES` by dtype, which :func:`pack_bucket` copies one group per call
    (:func:`~aiosync.core.bulk_copy.pack_tiny`); ``whole`` and ``payload``, the counts
    behind :attr:`whole_tensors` and :attr:`payload_bytes` (-1: count the specs); and
    ``slots``, the bucket message's slots once a sender made them (reused with the plan).
    """

    tensors: list[torch.Tensor] = field(default_factory=list)
    specs: list[TensorSpec] = field(default_factory=list)
    used: int = 0
    entries: list[int] = field(default_factory=list)
    tiny: dict[str, list[int]] = field(default_factory=dict)
    whole: int = -1
    payload: int = -1
    slots: list[Any] | None = None

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes carried (without alignment padding)."""
        if self.payload >= 0:
            return self.payload
        return sum(spec.nbytes for spec in self.specs)

    @property
    def whole_tensors(self) -> int:
        """Tensors whose last byte is in this bucket (whole ones and final chunks)."""
        if self.whole >= 0:
            return self.whole
        return sum(1 for spec in self.specs if spec.is_last_chunk)

    @property
    def first_name(self) -> str | None:
        """The first tensor's name, for error messages."""
        return self.specs[0].name if self.specs else None


MAX_BUCKET_ITEMS = 4096
"""Most tensors in one bucket: many small tensors still travel in several buckets, so the
engine applies one while the trainer packs the next."""


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    capacity: int,
    max_items: int = MAX_BUCKET_ITEMS,
) -> Iterator[BucketPlan]:
    """Lay out tensors, in order, into buckets that each fit a buffer of ``capacity`` bytes.

    Offsets are aligned to :data:`ALIGNMENT`. A tensor larger than ``capacity`` is split
    into consecutive byte ranges, each in a bucket of its own. A bucket holds at most
    ``max_items`` tensors.
    """
    if capacity < ALIGNMENT or capacity % ALIGNMENT:
        raise ValueError(f"buffer capacity must be a positive multiple of {ALIGNMENT}")
    plan = BucketPlan(whole=0, payload=0)
    seen: set[str] = set()
    names = DTYPE_NAMES
    for name, raw in named_tensors:
        if name in seen:
            raise MismatchError(f"tensor {name!r} appears twice in one sync", tensor=name)
        seen.add(name)
        tensor = raw if isinstance(raw, torch.Tensor) else materialize(raw)
        dtype = names.get(tensor.dtype)
        if dtype is None:
            raise MismatchError(f"dtype {tensor.dtype} cannot be streamed", tensor=name)
        shape = tuple(tensor.shape)
        nbytes = tensor.nbytes
        aligned = -(-nbytes // ALIGNMENT) * ALIGNMENT
        if plan.specs and (plan.used + aligned > capacity or len(plan.specs) >= max_items):
            yield plan
            plan = BucketPlan(whole=0, payload=0)
        if aligned <= capacity:
            if nbytes <= TINY_BYTES and len(shape) == 1:
                plan.tiny.setdefault(dtype, []).append(len(plan.specs))
            plan.tensors.append(tensor)
            plan.specs.append(TensorSpec(name, dtype, shape, plan.used, nbytes))
            plan.used += aligned
            plan.whole += 1
            plan.payload += nbytes
            continue
        yield from chunk_plans(tensor, TensorSpec(name, dtype, shape, 0, nbytes), capacity)
    if plan.specs:
        yield plan


def chunk_plans(tensor: torch.Tensor, whole: TensorSpec, capacity: int) -> Iterator[BucketPlan]:
    """The buckets of a tensor larger than ``capacity``, one byte range each, in order.

    ``whole`` describes the tensor (its ``nbytes`` all of it). The tensor is made plain
    (contiguous, conjugation and negation resolved) once, when the first chunk is reached.
    """
    flat = tensor.resolve_conj().resolve_neg().contiguous()  # one copy at most
    nbytes = whole.nbytes
    for start in range(0, nbytes, capacity):
        chunk = min(capacity, nbytes - start)
        spec = TensorSpec(whole.name, whole.dtype, whole.shape, 0, chunk, start)
        last = int(start + chunk == nbytes)
        yield BucketPlan([flat], [spec], calculate_aligned_size(chunk), whole=last, payload=chunk)


def is_plain(tensor: torch.Tensor) -> bool:
    """True when a tensor's memory holds exactly its values in order (bytes can be copied)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8)


_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16)


address_copy = ctypes.memmove
"""Copy ``n`` bytes between two CPU addresses (``address_copy(dst, src, n)``)."""

SMALL_COPY = 64 * 1024
"""Bytes up to which plain CPU tensors are copied by address: for small tensors, slicing
and viewing them with torch costs more than the copy. Larger ones go through
:func:`copy_bytes`, which measured as fast as ``memmove`` or a little faster."""


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between two flat ``uint8`` tensors of equal length, as wide integers if possible.

    The widest integer view both allow is used: 8-byte elements copy about 15% faster than
    single bytes on a CPU.
    """
    for dtype in _WIDE_DTYPES:
        size = dtype.itemsize
        if (
            dst.numel() % size == 0
            and dst.storage_offset() % size == 0 == src.storage_offset() % size
        ):
            dst.view(dtype).copy_(src.view(dtype), non_blocking=True)
            return
    dst.copy_(src, non_blocking=True)


def pack_bucket(buffer: torch.Tensor, plan: BucketPlan) -> None:
    """Copy each planned tensor into ``buffer`` (flat ``uint8``) at its spec's offset.

    Non-contiguous sources and sources on another device are copied correctly. Small plain
    CPU tensors into a CPU buffer are copied by address (see :data:`SMALL_COPY`); otherwise
    one ``copy_`` per item, which runs on the current CUDA stream for GPU buffers.
    """
    if plan.used > buffer.numel():
        raise ValueError(f"bucket needs {plan.used} bytes but the buffer holds {buffer.numel()}")
    base = buffer.data_ptr() if buffer.is_cpu else None
    packed = None
    if base is not None and plan.tiny:
        packed = pack_tiny(buffer, plan.tensors, plan.specs, plan.tiny)
        if packed is not None and packed.count(0) == 0:
            return  # every tensor was tiny
    for i, (source, spec) in enumerate(zip(plan.tensors, plan.specs, strict=True)):
        if spec.nbytes == 0 or (packed is not None and packed[i]):
            continue
        try:
            _pack_one(buffer, base, source, spec)
        except Exception as exc:
            raise MismatchError(f"cannot pack: {exc}", tensor=spec.name) from exc


def _pack_one(
    buffer: torch.Tensor, base: int | None, source: torch.Tensor, spec: TensorSpec
) -> None:
    """Copy one planned tensor (or chunk) into ``buffer``; ``base`` is its CPU address."""
    if base is not None and spec.nbytes <= SMALL_COPY and source.is_cpu and is_plain(source):
        address_copy(base + spec.offset, source.data_ptr() + spec.start, spec.nbytes)
        return
    dst = buffer[spec.offset : spec.offset + spec.nbytes]
    if not is_plain(source):  # whole, never chunked: the planner made chunks plain
        dst.view(source.dtype).view(source.shape).copy_(source)
        return
    src = tensor_bytes(source)
    if not spec.is_whole:
        src = src[spec.start : spec.start + spec.nbytes]
    copy_bytes(dst, src)


def validate_specs(
    specs: Sequence[TensorSpec],
    used: int,
    capacity: int,
    totals: Sequence[int] | None = None,
) -> list[int]:
    """Check that specs describe a well-formed bucket of ``used`` bytes in a buffer.

    Offsets must be aligned, ascending and non-overlapping; byte ranges must lie inside
    both the buffer and the tensor they belong to. Raises :class:`ProtocolError` naming
    the first bad tensor. Returns each spec's whole-tensor size, for the caller to reuse;
    ``totals`` gives them ahead (from a checked manifest), which skips the dtype and shape
    checks.
    """
    if not 0 <= used <= capacity:
        raise ProtocolError(f"bucket claims {used} bytes of a {capacity}-byte buffer")
    end = 0
    sizes = list(totals) if totals is not None else []
    for i, spec in enumerate(specs):
        if totals is not None:
            total = sizes[i]
        else:
            try:
                total = spec.total_nbytes
            except ProtocolError as exc:
                raise ProtocolError(exc.reason, tensor=spec.name) from None
            if any(dim < 0 for dim in spec.shape):
                raise ProtocolError("negative dimension in shape", tensor=spec.name)
            sizes.append(total)
        if spec.offset % ALIGNMENT or spec.offset < end:
            raise ProtocolError(f"misaligned or overlapping offset {spec.offset}", tensor=spec.name)
        if spec.nbytes < 0 or spec.start < 0 or spec.start + spec.nbytes > total:
            raise ProtocolError(
                f"byte range {spec.start}+{spec.nbytes} outside a {total}-byte tensor",
                tensor=spec.name,
            )
        if spec.offset + spec.nbytes > used:
            raise ProtocolError(
                f"bytes {spec.offset}+{spec.nbytes} run past the bucket's {used} bytes",
                tensor=spec.name,
            )
        end = spec.offset + spec.nbytes
    return sizes


def spec_bytes(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The flat ``uint8`` bytes of one spec in ``buffer`` (zero-copy)."""
    return buffer[spec.offset : spec.offset + spec.nbytes]


def bytes_as_tensor(raw: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """``raw`` (a spec's bytes) with the spec's dtype and shape, or as is for a chunk."""
    if not spec.is_whole:
        return raw
    return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)


def view_spec(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A zero-copy view of one spec's bytes in ``buffer``.

    Whole tensors come back with their dtype and shape; chunks as flat ``uint8``.
    """
    return bytes_as_tensor(spec_bytes(buffer, spec), spec)
