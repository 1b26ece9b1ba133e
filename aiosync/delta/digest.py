"""A digest of a version's bytes, computed on the tensors' device at close to read speed.

What it is for: an engine that applied a delta checks that its weights now hold exactly the
bytes the trainer sent (drift, a wrong base, a lost or corrupted write), and a sender checks
that an engine's base is the one it diffs against. It is a checksum, not a MAC: it is
unkeyed by default, and even with a ``key`` its first stage is linear, so anyone who wants
two versions with one digest can build them. It detects accidents, not adversaries.

How (``VersionDigest``, fed tensors in manifest order):

1. Each tensor's bytes are cut into rows of :data:`ROW_BYTES` (the last one zero-padded)
   and each row, read as signed bytes, is multiplied by a fixed matrix of :data:`COLUMNS`
   columns with entries in ``[-127, 127]`` without 0 (``torch._int_mm``, int8 in, int32
   out): one pass over the bytes on the device's integer matrix units, exact, so CPU and
   CUDA agree. A row that differs in one byte always changes its output; two rows whose
   bytes differ elsewhere collide with a probability near ``255**-8`` for a matrix drawn
   at random (the matrix is fixed, so this is about how likely drift is to hit it).
2. Each row's output (8 int32, seen as 4 int64) is added to a multiple of its position in
   the version (rows count across tensors, so order matters: two rows or two tensors
   swapped change the digest) and mixed by MurmurHash3's 64-bit finaliser; the mixed words
   are summed modulo ``2**64``. Each tensor's length and first row are mixed in too, so
   where one tensor ends and the next begins is part of what is digested.
3. The digest is the finaliser of that sum with the row count: 64 bits.

The bytes digested are a tensor's contiguous bytes, whatever its dtype (a version's bytes as
sent, before any cast). Outputs gather in a buffer mixed a block at a time, so a large
tensor costs one matrix product and a small one a copy into a staging block.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import torch

from aiosync.delta.ops import to_device

ROW_BYTES = 4096
"""Bytes per row of the first stage."""
COLUMNS = 8
"""Outputs per row (int32 each)."""
_MIN_ROWS = 17  # CUDA's int8 matrix product takes more than 16 rows
_STAGED_ROWS = 1024  # rows too short for a product of their own, multiplied together
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LENGTH = 0xD6E8FEB86659FD93
_M1, _M2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser on an unsigned 64-bit integer."""
    x &= _MASK64
    x ^= x >> 33
    x = (x * _M1) & _MASK64
    x ^= x >> 33
    x = (x * _M2) & _MASK64
    return x ^ (x >> 33)


def fmix64_(x: torch.Tensor) -> torch.Tensor:
    """:func:`fmix64` on an int64 tensor in place (two's complement, products wrap)."""
    low31 = (1 << 31) - 1
    for mult in (_M1, _M2, None):
        x ^= torch.bitwise_right_shift(x, 33).bitwise_and_(low31)
        if mult is not None:
            x.mul_(_signed(mult))
    return x


def _splitmix64(state: int) -> int:
    z = (state + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@lru_cache(maxsize=8)
def first_stage_matrix(key: int) -> torch.Tensor:
    """The first stage's matrix for ``key``, ``(COLUMNS, ROW_BYTES)`` int8 (CPU)."""
    seed = fmix64(key ^ 0x61696F73796E63)  # "aiosync"
    entries = []
    for i in range(COLUMNS * ROW_BYTES):
        v = _splitmix64(seed + i * _GOLDEN) % 254
        entries.append(v - 127 if v < 127 else v - 126)
    return torch.tensor(entries, dtype=torch.int8).view(COLUMNS, ROW_BYTES)


@lru_cache(maxsize=16)
def _matrix_on(key: int, device: torch.device) -> torch.Tensor:
    return to_device(first_stage_matrix(key), device)


def row_products(rows: torch.Tensor, matrix_t: torch.Tensor, out: torch.Tensor) -> None:
    """``out = rows @ matrix_t`` exactly: int8 rows (more than 16), int32 out.

    ``torch._int_mm`` where the device takes it, else float64 products (exact: every sum
    is below 2**53).
    """
    try:
        torch._int_mm(rows, matrix_t, out=out)
    except (RuntimeError, AttributeError):
        out.copy_(rows.to(torch.float64) @ matrix_t.to(torch.float64))


class VersionDigest:
    """The digest of a sequence of tensors' bytes (see the module's docstring).

    ``update`` each tensor in order; ``digest`` (or ``hexdigest``) waits for the device and
    may be called at any point (the digest of what was fed so far). Every tensor must be on
    one device. ``block_rows`` bounds the output buffer (32 bytes a row).
    """

    def __init__(self, *, key: int = 0, block_rows: int = 1 << 18) -> None:
        self.key = key
        self._salt = fmix64(key + _GOLDEN)
        self._block_rows = max(block_rows, 2 * _MIN_ROWS)
        self._device: torch.device | None = None
        self._rows = 0  # rows already mixed into the sum
        self._host = 0  # the lengths' terms, mod 2**64
        self._sum: torch.Tensor | None = None
        self._out: torch.Tensor | None = None  # (block_rows, COLUMNS) int32
        self._filled = 0
        self._staged: torch.Tensor | None = None  # (block rows, ROW_BYTES) int8
        self._slots: list[int] = []  # the output row of each staged row

    def _open(self, device: torch.device) -> None:
        if self._device is None:
            self._device = device
            self._matrix_t = _matrix_on(self.key, device).t()
            self._sum = torch.zeros((), dtype=torch.int64, device=device)
            self._out = torch.empty(_MIN_ROWS, COLUMNS, dtype=torch.int32, device=device)
            self._staged = torch.zeros(_MIN_ROWS, ROW_BYTES, dtype=torch.int8, device=device)
        elif device != self._device:
            raise ValueError(f"a digest runs on one device: {self._device}, then {device}")

    def _room(self, rows: int) -> int:
        """Grow the output buffer towards ``filled + rows`` rows; the rows it has room for."""
        out = self._out
        assert out is not None
        want = min(self._block_rows, self._filled + rows)
        if want > len(out):
            grown = torch.empty(
                min(self._block_rows, max(want, 2 * len(out))),
                COLUMNS,
                dtype=out.dtype,
                device=out.device,
            )
            grown[: self._filled].copy_(out[: self._filled])
            self._out = out = grown
        return len(out) - self._filled

    def update(self, tensor: torch.Tensor) -> None:
        """Add ``tensor``'s contiguous bytes as the next item of the sequence."""
        self._open(tensor.device)
        data = tensor.contiguous().reshape(-1).view(torch.uint8).view(torch.int8)
        nbytes = data.numel()
        first = self._rows + self._filled
        term = fmix64(nbytes ^ _LENGTH) + first * _GOLDEN
        self._host = (self._host + fmix64(term)) & _MASK64
        whole = nbytes // ROW_BYTES
        done = 0
        if whole >= _MIN_ROWS:
            rows = data[: whole * ROW_BYTES].view(whole, ROW_BYTES)
            while done < whole:  # blocks of at least _MIN_ROWS rows each
                left = whole - done
                room = self._room(left)
                take = min(room, left)
                if 0 < left - take < _MIN_ROWS:
                    take = left - _MIN_ROWS
                if take < _MIN_ROWS:
                    self._flush()
                    continue
                assert self._out is not None
                part = self._out[self._filled : self._filled + take]
                row_products(rows[done : done + take], self._matrix_t, part)
                self._filled += take
                done += take
        self._stage(data[done * ROW_BYTES :])

    def _stage(self, data: torch.Tensor) -> None:
        """Copy a tensor's last rows (too few for a product, the last one short) to stage.

        They are multiplied with other such rows at the next flush.
        """
        rows = -(-data.numel() // ROW_BYTES)
        if not rows:
            return
        if self._room(rows) < rows or len(self._slots) + rows > _STAGED_ROWS:
            self._flush()
            self._room(rows)
        staged = self._staged
        assert staged is not None
        first = len(self._slots)
        if first + rows > len(staged):
            grown = torch.zeros(
                min(_STAGED_ROWS, max(first + rows, 2 * len(staged))),
                ROW_BYTES,
                dtype=staged.dtype,
                device=staged.device,
            )
            grown[:first].copy_(staged[:first])
            self._staged = staged = grown
        staged[first : first + rows].view(-1)[: data.numel()].copy_(data)
        self._slots.extend(range(self._filled, self._filled + rows))
        self._filled += rows

    def _flush(self) -> None:
        if not self._filled:
            return
        out, staged, sum_ = self._out, self._staged, self._sum
        assert out is not None
        assert staged is not None
        assert sum_ is not None
        if self._slots:
            n = len(self._slots)
            block = torch.empty(max(n, _MIN_ROWS), COLUMNS, dtype=torch.int32, device=out.device)
            row_products(staged[: len(block)], self._matrix_t, block)
            slots = torch.tensor(self._slots, dtype=torch.int64)
            out.index_copy_(0, to_device(slots, out.device), block[:n])
            staged[:n].zero_()
            self._slots.clear()
        words = out[: self._filled].view(torch.int64).reshape(-1)
        x = torch.arange(
            4 * self._rows, 4 * (self._rows + self._filled), dtype=torch.int64, device=out.device
        )
        x.mul_(_signed(_GOLDEN)).add_(words).bitwise_xor_(_signed(self._salt))
        sum_ += fmix64_(x).sum()
        self._rows += self._filled
        self._filled = 0

    def digest(self) -> int:
        """The digest (an unsigned 64-bit integer) of every tensor fed so far."""
        self._flush()
        total = self._host
        if self._sum is not None:
            total += int(self._sum.item())
        return fmix64(total + self._rows * _LENGTH + self._salt)

    def hexdigest(self) -> str:
        """:meth:`digest` as 16 hexadecimal digits."""
        return f"{self.digest():016x}"


def version_digest(tensors: Iterable[torch.Tensor], *, key: int = 0) -> str:
    """The hex digest of tensors, in order (see :class:`VersionDigest`)."""
    digest = VersionDigest(key=key)
    for tensor in tensors:
        digest.update(tensor)
    return digest.hexdigest()
