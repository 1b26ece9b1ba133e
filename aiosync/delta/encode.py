"""Encoding a version of a tensor as a delta against a base: per chunk, the smallest form.

:func:`encode_delta` compares the two versions bit for bit (in the element's integer
width), counts the changed elements of each chunk, picks each chunk's encoding with
:func:`~aiosync.delta.format.encoding_bytes` and writes the payload, into a buffer the
caller gives or a new one. It reads each version once (the compare); what follows reads the
compare's mask and the changed values. Everything runs as torch operations on the tensors'
device; the host waits once per tensor, for the chunk table. :func:`encode_tensors` keeps
the device busy across that wait by comparing the next tensor before writing this one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy
import torch

from aiosync.core.errors import MismatchError, UsageError
from aiosync.delta.format import (
    BITMASK,
    CHUNK_BYTES,
    DENSE,
    KIND_NAMES,
    POSITIONS,
    DeltaHeader,
    Kinds,
    Table,
    bits_dtype,
    chunk_elems_for,
    chunk_lengths,
    encoding_bytes,
    header_nbytes,
)
from aiosync.delta.ops import HostCopy, count_rows, flat_bits, nonzero_flat, pack_bits, to_device


@dataclass(frozen=True)
class EncodedDelta:
    """One span of a tensor as a delta: its header, its payload, and what it saved."""

    header: DeltaHeader
    payload: torch.Tensor
    changed: int

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the span sent dense."""
        return self.header.count * self.header.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes the delta takes: its header's and its payload's."""
        return header_nbytes(self.header) + int(self.payload.numel())

    def chunks_by_kind(self) -> dict[str, int]:
        """How many chunks took each encoding."""
        kinds = self.header.kinds
        return {name: int((kinds == code).sum()) for code, name in enumerate(KIND_NAMES)}


class Measured:
    """A span compared and counted, its chunk table on its way to the host.

    The first half of an encode; :func:`write_delta` is the second.
    """

    def __init__(
        self, new: torch.Tensor, base: torch.Tensor, start: int, count: int, chunk_elems: int
    ) -> None:
        self.dtype, self.shape = new.dtype, tuple(new.shape)
        self.start, self.count, self.chunk_elems = start, count, chunk_elems
        self.new_bits = flat_bits(new)[start : start + count]
        base_bits = flat_bits(base)[start : start + count]
        if base_bits.device != self.new_bits.device:
            base_bits = base_bits.to(self.new_bits.device, non_blocking=True)
        self.mask = self.new_bits != base_bits
        full, tail = divmod(count, chunk_elems)
        counts = torch.empty(full + (1 if tail else 0), dtype=torch.int32, device=new.device)
        rows = self.mask[: full * chunk_elems].view(full, chunk_elems)
        if full:
            count_rows(rows, counts[:full])
        if tail:
            torch.sum(self.mask[full * chunk_elems :], 0, dtype=torch.int32, out=counts[full])
        self._counts = HostCopy(counts)

    @property
    def device(self) -> torch.device:
        """Where the span lives (and its payload is written)."""
        return self.new_bits.device

    def header(self) -> tuple[DeltaHeader, Table]:
        """The span's header and its changed elements per chunk (waits for the counts)."""
        counts = self._counts.get().numpy().astype(numpy.int64)
        lengths = chunk_lengths(self.count, self.chunk_elems)
        costs = numpy.stack(encoding_bytes(lengths, counts, self.dtype.itemsize))
        kinds = costs.argmin(0).astype(numpy.uint8)  # the first of equal costs
        values = numpy.where(kinds == DENSE, lengths, counts)
        header = DeltaHeader(
            self.dtype, self.shape, self.chunk_elems, self.start, self.count, kinds, values
        )
        return header, counts


def _spans_of(kinds: Kinds, kind: int) -> Table:
    return numpy.flatnonzero(kinds == kind)


def _only(mask: torch.Tensor, chunks: Table, changed: Table, header: DeltaHeader) -> torch.Tensor:
    """The changed ``mask`` with the elements outside ``chunks`` (chunk indices) cleared."""
    keep = numpy.zeros(len(changed), dtype=numpy.bool_)
    keep[chunks] = True
    if bool((keep | (changed == 0)).all()):
        return mask  # nothing is set outside them
    ce, count = header.chunk_elems, header.count
    full = count // ce
    keep_dev = to_device(keep, mask.device)
    out = torch.empty_like(mask)
    if full:
        torch.logical_and(
            mask[: full * ce].view(full, ce),
            keep_dev[:full, None],
            out=out[: full * ce].view(full, ce),
        )
    if count > full * ce:
        torch.logical_and(mask[full * ce :], keep_dev[full], out=out[full * ce :])
    return out


def _rows(flat: torch.Tensor, chunks: Table, header: DeltaHeader) -> torch.Tensor | None:
    """The whole chunks among ``chunks`` as rows of ``flat`` (a copy unless all of them)."""
    ce = header.chunk_elems
    full = header.count // ce
    chunks = chunks[chunks < full]
    if not len(chunks):
        return None
    table = flat[: full * ce].view(full, ce)
    if len(chunks) == full:
        return table
    return table.index_select(0, to_device(chunks, flat.device))


def write_delta(measured: Measured, out: torch.Tensor | None = None) -> EncodedDelta:
    """Write the payload of a measured span into ``out``, or a new tensor if None.

    ``out``: flat uint8 on the span's device, 8-byte aligned, at least
    :func:`~aiosync.delta.format.max_payload_bytes` long (:class:`UsageError` if not).
    """
    header, changed = measured.header()
    sec = header.sections
    device, bits = measured.device, measured.new_bits.dtype
    if out is None:
        payload = torch.empty(sec.nbytes, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
            raise UsageError("a delta's out buffer must be a flat contiguous uint8 tensor")
        if out.device != device or out.storage_offset() % 8 or out.numel() < sec.nbytes:
            raise UsageError(
                f"a delta's out buffer must be on {device}, 8-byte aligned and hold"
                f" {sec.nbytes} bytes (got {out.numel()} on {out.device})"
            )
        payload = out[: sec.nbytes]
    n_values = sec.values[1]
    values = payload[: n_values * measured.dtype.itemsize].view(bits)
    g_pos, g_bm, _ = sec.value_groups
    p_at, n_pos = sec.positions
    b_at, n_bm_bytes = sec.bitmask
    for start, stop in ((n_values * measured.dtype.itemsize, p_at), (p_at + 4 * n_pos, b_at)):
        if stop > start:
            payload[start:stop].zero_()
    new, changed_mask = measured.new_bits, measured.mask
    ce, count, kinds = header.chunk_elems, header.count, header.kinds
    full = count // ce
    if g_pos + g_bm:  # one pass finds the changes of positions and bitmask chunks
        sparse = _only(changed_mask, numpy.flatnonzero(kinds != DENSE), changed, header)
        found = nonzero_flat(sparse, g_pos + g_bm)
        in_positions, in_bitmasks = found, found
        if g_pos and g_bm:  # both kinds: split by the kind of each change's chunk
            kind = to_device(kinds, device)[found // ce]
            in_positions = found[nonzero_flat(kind == POSITIONS, g_pos)]
            in_bitmasks = found[nonzero_flat(kind == BITMASK, g_bm)]
        if g_pos:
            payload[p_at : p_at + 4 * n_pos].view(torch.int32).copy_(in_positions.remainder(ce))
            torch.index_select(new, 0, in_positions, out=values[:g_pos])
        if g_bm:
            torch.index_select(new, 0, in_bitmasks, out=values[g_pos : g_pos + g_bm])
    bm_chunks = _spans_of(kinds, BITMASK)
    if len(bm_chunks):
        rows = _rows(changed_mask, bm_chunks, header)
        packed = payload[b_at : b_at + n_bm_bytes]
        whole = 0 if rows is None else rows.numel() // 8
        if rows is not None:
            pack_bits(rows.reshape(-1), packed[:whole])
        if int(bm_chunks[-1]) == full:  # the last, shorter chunk
            tail = torch.zeros(n_bm_bytes * 8 - whole * 8, dtype=torch.bool, device=device)
            tail[: count - full * ce] = changed_mask[full * ce :]
            pack_bits(tail, packed[whole:])
    dense_chunks = _spans_of(kinds, DENSE)
    if len(dense_chunks):
        dense = values[g_pos + g_bm :]
        rows = _rows(new, dense_chunks, header)
        whole = 0 if rows is None else rows.numel()
        if rows is not None:
            dense[:whole].view(-1, ce).copy_(rows)
        if int(dense_chunks[-1]) == full:
            dense[whole:].copy_(new[full * ce :])
    return EncodedDelta(header, payload, int(changed.sum()))


def _check_pair(new: torch.Tensor, base: torch.Tensor, tensor: str | None) -> None:
    bits_dtype(new.dtype, tensor=tensor)
    if new.dtype != base.dtype or new.shape != base.shape:
        raise MismatchError(
            f"cannot diff {new.dtype}{list(new.shape)} against {base.dtype}{list(base.shape)}",
            tensor=tensor,
        )


def measure_delta(
    new: torch.Tensor,
    base: torch.Tensor,
    *,
    start: int = 0,
    count: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    tensor: str | None = None,
) -> Measured:
    """Compare ``new`` with ``base`` over a span of whole chunks (the whole tensor by default).

    ``base`` may live on another device (it is copied to ``new``'s for the compare).
    :class:`MismatchError` if the two differ in dtype or shape, or the dtype has no delta.
    """
    _check_pair(new, base, tensor)
    chunk_elems = chunk_elems_for(new.dtype, chunk_bytes)
    numel = new.numel()
    count = numel - start if count is None else count
    if start % chunk_elems or start < 0 or count < 0 or start + count > numel:
        raise UsageError(f"span [{start}, {start + count}) is not whole chunks of {numel}")
    if start + count < numel and count % chunk_elems:
        raise UsageError(f"a span ending before the tensor's end is whole chunks of {chunk_elems}")
    return Measured(new, base, start, count, chunk_elems)


def encode_delta(
    new: torch.Tensor,
    base: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    start: int = 0,
    count: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    tensor: str | None = None,
) -> EncodedDelta:
    """``new`` as a delta against ``base`` (see :func:`measure_delta` and :func:`write_delta`)."""
    measured = measure_delta(
        new, base, start=start, count=count, chunk_bytes=chunk_bytes, tensor=tensor
    )
    return write_delta(measured, out)


def encode_tensors(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
    outs: Sequence[torch.Tensor] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[EncodedDelta]:
    """Encode each ``(new, base)`` whole, in order, into ``outs`` (or new tensors).

    The next pair's compare is queued before this one's write, so that the device does not
    idle while the host reads a chunk table.
    """
    pending: Measured | None = None
    index = 0
    for new, base in pairs:
        measured = measure_delta(new, base, chunk_bytes=chunk_bytes)
        if pending is not None:
            yield write_delta(pending, None if outs is None else outs[index])
            index += 1
        pending = measured
    if pending is not None:
        yield write_delta(pending, None if outs is None else outs[index])
