"""Applying a delta onto the base tensor an engine holds, in place, bit for bit.

Everything the decoder reads may be hostile. :func:`apply_delta` checks all of it before it
writes a byte, so a refused delta leaves the base as it was: the header (see
:meth:`~aiosync.delta.format.DeltaHeader.from_bytes`) and its fit to the base
(:class:`MismatchError`: dtype, shape, a non-contiguous base), the payload's exact length,
then on the device, in one wait: every position inside its chunk and strictly increasing
within it (unsorted or repeated positions are refused: with a repeat, which value lands
would depend on the order of a scatter), each bitmask's set bits equal to its chunk's value
count, and the unused bits of a last, shorter chunk's bitmask clear. Any failure is a
:class:`ProtocolError` naming the tensor and version given.
"""

from __future__ import annotations

import numpy
import torch

from aiosync.core.errors import ProtocolError
from aiosync.delta.format import (
    BITMASK,
    DENSE,
    POSITIONS,
    DeltaHeader,
    bits_dtype,
)
from aiosync.delta.ops import flat_bits, nonzero_flat, set_bits, to_device, unpack_bits

_CHECKS = (
    "a position outside its chunk",
    "positions not strictly increasing within a chunk",
    "bits set past the end of the last chunk's bitmask",
    "a bitmask whose set bits differ from its chunk's value count",
)


def _payload_on(payload: torch.Tensor, device: torch.device, bad: ProtocolError) -> torch.Tensor:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise bad
    payload = payload.to(device, non_blocking=True)
    if not payload.is_contiguous() or payload.storage_offset() % 8:
        payload = payload.clone()  # the sections are read as wider integers
    return payload


def apply_delta(
    base: torch.Tensor,
    header: DeltaHeader | bytes | bytearray | memoryview,
    payload: torch.Tensor,
    *,
    tensor: str | None = None,
    version: int | None = None,
) -> None:
    """Write the span ``header`` and ``payload`` describe into ``base``, after checking all.

    ``header`` may be the header's bytes; ``payload`` is a flat uint8 tensor on any device
    (copied to ``base``'s if elsewhere). Raises :class:`MismatchError` or
    :class:`ProtocolError` (``tensor`` and ``version`` name what failed) with ``base``
    untouched.
    """
    if isinstance(header, DeltaHeader):
        header.validate(tensor=tensor, version=version)
    else:
        header = DeltaHeader.from_bytes(header, tensor=tensor, version=version)
    header.check_fits(base, tensor=tensor, version=version)
    sec = header.sections
    payload = _payload_on(
        payload,
        base.device,
        ProtocolError("a delta's payload must be flat uint8", tensor=tensor, version=version),
    )
    if payload.numel() != sec.nbytes:
        raise ProtocolError(
            f"delta payload of {payload.numel()} bytes where its header describes {sec.nbytes}"
            f" ({sec.values[1]} values, {sec.positions[1]} positions, {sec.bitmask[1]} bitmask"
            " bytes)",
            tensor=tensor,
            version=version,
        )
    steps = _Steps(header, payload, base.device)
    failed = steps.failures()
    if failed:
        raise ProtocolError(f"delta refused: {failed[0]}", tensor=tensor, version=version)
    steps.write(flat_bits(base)[header.start : header.start + header.count])


class _Steps:
    """A checked header's payload read as positions, bitmasks and values, on the device."""

    def __init__(self, header: DeltaHeader, payload: torch.Tensor, device: torch.device) -> None:
        self.header, self.device = header, device
        sec = header.sections
        bits = bits_dtype(header.dtype)
        self.values = payload[: sec.values[1] * header.dtype.itemsize].view(bits)
        self.groups = sec.value_groups
        at, n = sec.positions
        self.positions = payload[at : at + 4 * n].view(torch.int32)
        at, n = sec.bitmask
        self.bitmask = payload[at : at + n]
        kinds, values = header.kinds, header.values
        self.pos_chunks = numpy.flatnonzero(kinds == POSITIONS)
        self.bm_chunks = numpy.flatnonzero(kinds == BITMASK)
        self.dense_chunks = numpy.flatnonzero(kinds == DENSE)
        self.bm_values = values[self.bm_chunks].astype(numpy.int32)
        self.where: torch.Tensor | None = None  # span offsets of the positions' values
        self.set_bits: torch.Tensor | None = None  # the bitmask chunks' bits, concatenated

    def failures(self) -> list[str]:
        """The device checks that fail, in the order of ``_CHECKS`` (one wait for all)."""
        header, device = self.header, self.device
        ce, count = header.chunk_elems, header.count
        checks: list[tuple[str, torch.Tensor]] = []
        if self.groups[0]:
            per_chunk = header.values[self.pos_chunks]
            chunk_of = torch.repeat_interleave(
                to_device(self.pos_chunks, device),
                to_device(per_chunk, device),
                output_size=self.groups[0],
            )
            pos = self.positions.to(torch.int64)
            where = pos + chunk_of * ce
            checks.append((_CHECKS[0], ((pos >= 0) & (pos < ce) & (where < count)).all()))
            checks.append((_CHECKS[1], (where[1:] > where[:-1]).all()))
            self.where = where
        if len(self.bm_chunks):
            full = count // ce
            whole = int((self.bm_chunks < full).sum())
            expected = to_device(self.bm_values, device)
            sums = torch.empty(len(self.bm_chunks), dtype=torch.int32, device=device)
            ones = set_bits(self.bitmask)
            if whole:
                rows = ones[: whole * ce // 8].view(whole, ce // 8)
                torch.sum(rows, 1, dtype=torch.int32, out=sums[:whole])
            if whole < len(self.bm_chunks):  # the last, shorter chunk
                torch.sum(ones[whole * ce // 8 :], 0, dtype=torch.int32, out=sums[whole])
                unused = 8 * (self.bitmask.numel() - whole * ce // 8) - (count - full * ce)
                if unused:  # the low bits of the last byte
                    clear = (self.bitmask[-1:] & ((1 << unused) - 1)).eq(0).all()
                    checks.append((_CHECKS[2], clear))
            checks.append((_CHECKS[3], (sums == expected).all()))
            self.set_bits = unpack_bits(self.bitmask)
        if not checks:
            return []
        passed = torch.stack([ok for _, ok in checks]).tolist()
        return [reason for (reason, _), ok in zip(checks, passed, strict=True) if not ok]

    def write(self, span: torch.Tensor) -> None:
        """Write the checked values into ``span`` (the base's elements the header covers)."""
        header, device = self.header, self.device
        ce, count = header.chunk_elems, header.count
        g_pos, g_bm, _ = self.groups
        full = count // ce
        if self.where is not None:
            span.index_copy_(0, self.where, self.values[:g_pos])
        if g_bm and self.set_bits is not None:
            found = nonzero_flat(self.set_bits, g_bm)  # offsets in the bitmask chunks
            if len(self.bm_chunks) != len(header.kinds):  # to offsets in the span
                chunk = to_device(self.bm_chunks, device)[found // ce]
                found = chunk * ce + found % ce
            span.index_copy_(0, found, self.values[g_pos : g_pos + g_bm])
        if len(self.dense_chunks):
            dense = self.values[g_pos + g_bm :]
            rows = self.dense_chunks[self.dense_chunks < full]
            whole = len(rows) * ce
            if len(rows) == full:
                span[:whole].copy_(dense[:whole])
            elif len(rows):
                table = span[: full * ce].view(full, ce)
                table.index_copy_(0, to_device(rows, device), dense[:whole].view(-1, ce))
            if whole < dense.numel():
                span[full * ce :].copy_(dense[whole:])
