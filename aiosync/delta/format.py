"""The byte format of one encoded delta: its header, its payload's sections, their sizes.

A delta carries one *span* of a tensor: a run of whole chunks (fixed-size flat ranges of
its elements, the last one possibly shorter) from ``start`` for ``count`` elements. Each
chunk is encoded on its own, in one of three ways (:data:`POSITIONS`, :data:`BITMASK`,
:data:`DENSE`), whichever is smallest for the number of elements that changed in it; an
unchanged chunk is a positions chunk with no entries and costs nothing in the payload.

The header (:class:`DeltaHeader`, little-endian, :meth:`DeltaHeader.to_bytes`)::

    magic "ADL1" | format 1 (u8) | dtype code (u8) | ndim (u8) | flags 0 (u8)
    chunk_elems (u32) | start (u64) | count (u64) | nchunks (u32)
    dims (u64 x ndim) | values per chunk (u32 x nchunks) | kind per chunk (u8 x nchunks)

A chunk's value count is the number of changed elements for positions and bitmask chunks
and its length for a dense one. The payload (flat ``uint8``) holds three sections, each
starting at a multiple of 8 bytes, their sizes a function of the header alone
(:attr:`DeltaHeader.sections`): the values (the tensor's dtype: the positions chunks'
values, then the bitmask chunks', then the dense chunks', each group in chunk order); the
positions (int32,
element offsets inside their chunk, strictly increasing within a chunk); the bitmasks
(``ceil(length / 8)`` bytes per bitmask chunk, element ``i`` in bit ``7 - i % 8`` of byte
``i // 8``, the most significant bit first; unused bits of the last byte zero).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import numpy
import numpy.typing as npt
import torch

from aiosync.core.errors import MismatchError, ProtocolError
from aiosync.core.layout import DTYPE_NAMES, dtype_from_name, dtype_name

POSITIONS = 0
"""A chunk sent as the int32 positions of its changed elements and their values."""
BITMASK = 1
"""A chunk sent as one bit per element (set: changed) and the changed elements' values."""
DENSE = 2
"""A chunk sent whole."""
KIND_NAMES = ("positions", "bitmask", "dense")
"""The name of each encoding, by its code."""

MAGIC = b"ADL1"
FORMAT = 1
CHUNK_BYTES = 1 << 20
"""Default chunk size in bytes: a chunk's encoding is chosen from its own density."""
MAX_CHUNK_ELEMS = 1 << 30
"""Largest chunk a header may declare (positions are int32 offsets inside a chunk)."""
MAX_NDIM = 32

_FIXED = struct.Struct("<4sBBBBIQQI")
_SECTION_ALIGN = 8

# Codes are positions in this tuple; append only (a code's meaning never changes).
DTYPE_CODES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(dtype: torch.dtype, *, tensor: str | None = None) -> torch.dtype:
    """The integer dtype of ``dtype``'s width, in which elements are compared and moved.

    Comparing bit patterns makes the delta exact: ``-0.0`` differs from ``0.0`` and a NaN
    keeps its payload. :class:`MismatchError` for a dtype no delta carries.
    """
    name = DTYPE_NAMES.get(dtype)
    if name not in DTYPE_CODES:
        raise MismatchError(f"no delta encoding for {dtype}; send it dense", tensor=tensor)
    return _BITS_DTYPES[dtype.itemsize]


def chunk_elems_for(dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Elements per chunk of ``chunk_bytes`` (rounded down to a multiple of 8, at least 8)."""
    return max(8, min(MAX_CHUNK_ELEMS, chunk_bytes // dtype.itemsize) // 8 * 8)


Table = npt.NDArray[numpy.int64]
"""One integer per chunk (host memory)."""
Kinds = npt.NDArray[numpy.uint8]
"""Each chunk's encoding (host memory)."""
Count = TypeVar("Count", int, Table)


def encoding_bytes(length: Count, changed: Count, itemsize: int) -> tuple[Count, Count, Count]:
    """Payload bytes of a chunk of ``length`` elements, ``changed`` of them changed, per kind.

    ``(positions, bitmask, dense)``; works on ints and on integer arrays (per chunk). The
    encoder picks the smallest (the first of equals), and the cost model estimates with it.
    """
    positions = changed * (4 + itemsize)
    bitmask = (length + 7) // 8 + changed * itemsize
    dense = length * itemsize
    return positions, bitmask, dense


def _chunk_ok(chunk: int) -> bool:
    return 0 < chunk <= MAX_CHUNK_ELEMS and chunk % 8 == 0


def _bad(reason: str, tensor: str | None, version: int | None) -> ProtocolError:
    return ProtocolError(f"delta header: {reason}", tensor=tensor, version=version)


def chunk_lengths(count: int, chunk_elems: int) -> Table:
    """Elements of each chunk of a span of ``count`` elements."""
    nchunks = -(-count // chunk_elems)
    lengths = numpy.full(nchunks, chunk_elems, dtype=numpy.int64)
    if nchunks:
        lengths[-1] = count - (nchunks - 1) * chunk_elems
    return lengths


def _align(n: int) -> int:
    return -(-n // _SECTION_ALIGN) * _SECTION_ALIGN


@dataclass(frozen=True)
class Sections:
    """Where a payload's sections lie, in bytes and in elements (from the header alone)."""

    values: tuple[int, int]  # byte offset, elements
    value_groups: tuple[int, int, int]  # elements of positions, bitmask, dense chunks
    positions: tuple[int, int]  # byte offset, int32 entries
    bitmask: tuple[int, int]  # byte offset, bytes
    nbytes: int


@dataclass(frozen=True, eq=False)
class DeltaHeader:
    """What a payload encodes: the tensor's dtype and shape, the span, each chunk's encoding.

    ``kinds`` and ``values`` (each chunk's value count) are arrays with one entry per chunk.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunk_elems: int
    start: int
    count: int
    kinds: Kinds
    values: Table

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nchunks(self) -> int:
        """Chunks in the span."""
        return -(-self.count // self.chunk_elems)

    def chunk_lengths(self) -> Table:
        """Elements of each chunk of the span."""
        return chunk_lengths(self.count, self.chunk_elems)

    @cached_property
    def sections(self) -> Sections:
        """The payload's layout this header describes (see the module's docstring)."""
        kinds, values = self.kinds, self.values
        groups = [int(values[kinds == kind].sum()) for kind in (POSITIONS, BITMASK, DENSE)]
        bitmasks = int((kinds == BITMASK).sum())
        bitmask_bytes = bitmasks * (self.chunk_elems // 8)
        if bitmasks and kinds[-1] == BITMASK:  # the last chunk may be shorter
            last = self.count - (self.nchunks - 1) * self.chunk_elems
            bitmask_bytes -= self.chunk_elems // 8 - -(-last // 8)
        value_bytes = sum(groups) * self.dtype.itemsize
        positions_at = _align(value_bytes)
        bitmask_at = positions_at + _align(4 * groups[0])
        return Sections(
            values=(0, sum(groups)),
            value_groups=(groups[0], groups[1], groups[2]),
            positions=(positions_at, groups[0]),
            bitmask=(bitmask_at, bitmask_bytes),
            nbytes=bitmask_at + bitmask_bytes,
        )

    def to_bytes(self) -> bytes:
        """The header as it travels (see the module's docstring)."""
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT,
            DTYPE_CODES.index(dtype_name(self.dtype)),
            len(self.shape),
            0,
            self.chunk_elems,
            self.start,
            self.count,
            self.nchunks,
        )
        dims = struct.pack(f"<{len(self.shape)}Q", *self.shape)
        values = self.values.astype("<u4").tobytes()
        return fixed + dims + values + self.kinds.astype(numpy.uint8).tobytes()

    @classmethod
    def from_bytes(
        cls, raw: bytes | bytearray | memoryview, *, tensor: str | None, version: int | None
    ) -> DeltaHeader:
        """Parse and check a header; :class:`ProtocolError` for anything malformed.

        Checked: magic, format, dtype code, flags, dimensions, the stated chunk count, the
        exact length, then what :meth:`validate` checks.
        """

        def bad(reason: str) -> ProtocolError:
            return _bad(reason, tensor, version)

        if len(raw) < _FIXED.size:
            raise bad(f"truncated ({len(raw)} bytes, at least {_FIXED.size} needed)")
        magic, fmt, code, ndim, flags, chunk, start, count, nchunks = _FIXED.unpack_from(raw)
        if magic != MAGIC or fmt != FORMAT:
            raise bad(f"not a format-{FORMAT} delta (magic {magic!r}, format {fmt})")
        if flags:
            raise bad("reserved flags are not zero")
        if code >= len(DTYPE_CODES):
            raise bad(f"unknown dtype code {code}")
        dtype = dtype_from_name(DTYPE_CODES[code])
        if ndim > MAX_NDIM:
            raise bad(f"{ndim} dimensions (at most {MAX_NDIM})")
        dims_end = _FIXED.size + 8 * ndim
        if len(raw) < dims_end:
            raise bad(f"truncated in its dimensions ({len(raw)} bytes)")
        shape = struct.unpack_from(f"<{ndim}Q", raw, _FIXED.size)
        if not _chunk_ok(chunk):  # before it divides anything
            raise bad(f"chunk of {chunk} elements (a positive multiple of 8 up to 2**30)")
        if nchunks != -(-count // chunk):
            raise bad(f"{nchunks} chunks stated for {count} elements in chunks of {chunk}")
        if len(raw) != dims_end + 5 * nchunks:
            raise bad(f"{len(raw)} bytes where {dims_end + 5 * nchunks} describe {nchunks} chunks")
        values = numpy.frombuffer(raw, "<u4", count=nchunks, offset=dims_end).astype(numpy.int64)
        kinds = numpy.frombuffer(raw, numpy.uint8, offset=dims_end + 4 * nchunks).copy()
        header = cls(dtype, tuple(shape), chunk, start, count, kinds, values)
        header.validate(tensor=tensor, version=version)
        return header

    def validate(self, *, tensor: str | None, version: int | None) -> None:
        """:class:`ProtocolError` unless the header is consistent.

        A chunk size that is a multiple of 8 up to :data:`MAX_CHUNK_ELEMS`, a span of whole
        chunks inside the tensor, one kind and one value count per chunk, known kinds, and
        each chunk's value count at most its length (exactly its length when dense).
        """
        chunk, start, count, numel = self.chunk_elems, self.start, self.count, self.numel
        kinds, values = self.kinds, self.values
        if not _chunk_ok(chunk):
            raise _bad(
                f"chunk of {chunk} elements (a positive multiple of 8 up to 2**30)", tensor, version
            )
        if start < 0 or start % chunk or start + count > numel or (count <= 0 and numel):
            raise _bad(
                f"span [{start}, {start + count}) is not whole chunks of {numel} elements",
                tensor,
                version,
            )
        if kinds.shape != (self.nchunks,) or values.shape != (self.nchunks,):
            raise _bad(
                f"a table of {len(kinds)} kinds and {len(values)} counts for {self.nchunks} chunks",
                tensor,
                version,
            )
        if self.nchunks and int(kinds.max()) > DENSE:
            raise _bad(f"unknown chunk encoding {int(kinds.max())}", tensor, version)
        lengths = self.chunk_lengths()
        over = numpy.flatnonzero((values > lengths) | (values < 0))
        if len(over):
            i = int(over[0])
            raise _bad(
                f"chunk {i} states {values[i]} values for {lengths[i]} elements", tensor, version
            )
        short = numpy.flatnonzero((kinds == DENSE) & (values != lengths))
        if len(short):
            i = int(short[0])
            raise _bad(
                f"dense chunk {i} states {values[i]} values, not {lengths[i]}", tensor, version
            )

    def check_fits(self, base: torch.Tensor, *, tensor: str | None, version: int | None) -> None:
        """:class:`MismatchError` unless ``base`` is a contiguous tensor of this dtype and shape."""
        if base.dtype != self.dtype or tuple(base.shape) != self.shape:
            raise MismatchError(
                f"delta for {dtype_name(self.dtype)}{list(self.shape)} cannot apply to"
                f" {dtype_name(base.dtype)}{list(base.shape)}",
                tensor=tensor,
                version=version,
            )
        if not base.is_contiguous():
            raise MismatchError(
                "a delta applies to contiguous tensors only", tensor=tensor, version=version
            )


def max_payload_bytes(count: int, dtype: torch.dtype) -> int:
    """An upper bound on the payload of a span of ``count`` elements of ``dtype``.

    An out buffer this large always suffices: no chunk is larger than dense, and the
    sections' alignment adds at most 16 bytes.
    """
    return count * dtype.itemsize + 2 * _SECTION_ALIGN


def header_nbytes(header: DeltaHeader) -> int:
    """Bytes of ``header`` as :meth:`DeltaHeader.to_bytes` writes it."""
    return _FIXED.size + 8 * len(header.shape) + 5 * header.nchunks
