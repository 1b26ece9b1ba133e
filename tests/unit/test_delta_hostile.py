"""A decoder fed hostile deltas refuses each with a clear error and leaves the base as it was.

The fuzz at the end compares :func:`aiosync.delta.apply_delta` with a plain Python reading
of the format (``reference_apply``): every delta one accepts the other accepts, with the
same result, and every refusal is an ``AiosyncError`` with the base untouched.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import replace

import numpy
import pytest
import torch

from aiosync.core.errors import AiosyncError, MismatchError, ProtocolError
from aiosync.delta import BITMASK, DENSE, POSITIONS, DeltaHeader, apply_delta, encode_delta
from aiosync.delta.ops import flat_bits
from tests.helpers.deltas import changed_copy, random_tensor

CHUNK = 256  # bytes: 128 bf16 elements a chunk
FIXED = 32  # bytes of a header before its dimensions


def encoded(density: float, n: int = 1000, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    base = random_tensor((n,), dtype, seed=seed)
    new, _ = changed_copy(base, density, seed=seed + 1)
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    return base, bytearray(delta.header.to_bytes()), delta.payload.clone()


def refused(
    base: torch.Tensor, header: bytes | bytearray | DeltaHeader, payload: torch.Tensor
) -> AiosyncError:
    before = base.clone()
    with pytest.raises(AiosyncError) as info:
        apply_delta(base, header, payload, tensor="layers.0.w", version=7)
    assert torch.equal(flat_bits(base), flat_bits(before)), "a refused delta wrote the base"
    assert (info.value.tensor, info.value.version) == ("layers.0.w", 7)
    return info.value


def patched(header: bytearray, offset: int, fmt: str, value: int) -> bytearray:
    out = bytearray(header)
    struct.pack_into(fmt, out, offset, value)
    return out


def table_offset(raw: bytearray) -> int:
    return FIXED + 8 * raw[6]


def test_a_truncated_or_padded_header_is_refused() -> None:
    base, header, payload = encoded(0.05)
    for cut in (0, 3, FIXED - 1, FIXED, FIXED + 7, len(header) - 1):
        assert isinstance(refused(base, header[:cut], payload), ProtocolError)
    assert "bytes where" in str(refused(base, header + b"\0", payload))


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "says"),
    [
        (0, "<4s", b"XDL1", "magic"),
        (4, "<B", 2, "format"),
        (5, "<B", 200, "dtype code"),
        (7, "<B", 1, "reserved"),
        (8, "<I", 100, "multiple of 8"),
        (8, "<I", 0, "multiple of 8"),
        (12, "<Q", 128, "span"),  # starts inside the tensor but runs past it
        (20, "<Q", 2000, "chunks stated"),
        (28, "<I", 9, "chunks stated"),
    ],
)
def test_a_malformed_header_is_refused(offset: int, fmt: str, value: object, says: str) -> None:
    base, header, payload = encoded(0.05)
    raw = bytearray(header)
    struct.pack_into(fmt, raw, offset, value)
    error = refused(base, raw, payload)
    assert isinstance(error, ProtocolError)
    assert says in str(error)


def test_a_header_object_is_checked_as_its_bytes_would_be() -> None:
    base, raw, payload = encoded(0.05)
    header = DeltaHeader.from_bytes(raw, tensor=None, version=None)
    twice = numpy.concatenate([header.kinds, header.kinds])
    cases = {
        "span": replace(header, count=2000, kinds=twice, values=numpy.tile(header.values, 2)),
        "multiple of 8": replace(header, chunk_elems=100),
        "a table of": replace(header, kinds=header.kinds[:-1]),
        "unknown chunk encoding": replace(header, kinds=header.kinds + 3),
        "states -1 values": replace(header, values=header.values - 1 - header.values),
    }
    for says, bad in cases.items():
        assert says in str(refused(base, bad, payload)), says


def test_a_delta_for_another_dtype_or_shape_is_a_mismatch() -> None:
    base, header, payload = encoded(0.05)
    assert "cannot apply" in str(refused(base.to(torch.float16), header, payload))
    assert isinstance(refused(base.view(10, 100), header, payload), MismatchError)
    longer = torch.zeros(1001, dtype=torch.bfloat16)
    assert isinstance(refused(longer, header, payload), MismatchError)
    strided = torch.zeros(2000, dtype=torch.bfloat16)[::2]
    assert "contiguous" in str(refused(strided, header, payload))


def test_a_count_past_its_chunk_or_an_unknown_kind_is_refused() -> None:
    base, header, payload = encoded(0.05)
    at = table_offset(header)
    nchunks = (len(header) - at) // 5
    assert "states 129 values" in str(refused(base, patched(header, at, "<I", 129), payload))
    last = at + 4 * (nchunks - 1)  # the last chunk holds 1000 - 7 * 128 = 104 elements
    assert "for 104 elements" in str(refused(base, patched(header, last, "<I", 105), payload))
    assert "unknown chunk encoding" in str(
        refused(base, patched(header, at + 4 * nchunks, "<B", 3), payload)
    )
    dense = patched(header, at + 4 * nchunks, "<B", DENSE)
    assert "dense chunk 0" in str(refused(base, dense, payload))


def test_a_truncated_or_overlong_payload_is_refused() -> None:
    base, header, payload = encoded(0.05)
    for bad in (payload[:-1], payload[:0], torch.cat([payload, payload[:1]])):
        assert "payload of" in str(refused(base, header, bad))
    assert "flat uint8" in str(refused(base, header, payload.view(torch.int8)))
    assert "flat uint8" in str(refused(base, header, payload.view(1, -1)))


def positions_delta() -> tuple[torch.Tensor, DeltaHeader, torch.Tensor]:
    base = torch.zeros(300, dtype=torch.float32)
    new = base.clone()
    new[[3, 70, 71, 200, 290]] = 1.0  # chunks of 64: positions chunks, the last one short
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    assert set(delta.header.kinds.tolist()) == {POSITIONS}
    return base, delta.header, delta.payload.clone()


def with_positions(payload: torch.Tensor, header: DeltaHeader, positions: list[int]):
    at, n = header.sections.positions
    out = payload.clone()
    out[at : at + 4 * n].view(torch.int32).copy_(torch.tensor(positions, dtype=torch.int32))
    return out


@pytest.mark.parametrize(
    ("positions", "says"),
    [
        ([3, 6, 7, 8, 34], None),  # the valid ones, for reference: what each case breaks
        ([64, 6, 7, 8, 34], "outside its chunk"),
        ([-1, 6, 7, 8, 34], "outside its chunk"),
        ([3, 6, 7, 8, 44], "outside its chunk"),  # past the short last chunk (44 elements)
        ([3, 7, 6, 8, 34], "strictly increasing"),
        ([3, 6, 6, 8, 34], "strictly increasing"),
    ],
)
def test_positions_out_of_range_unsorted_or_repeated_are_refused(
    positions: list[int], says: str | None
) -> None:
    base, header, payload = positions_delta()
    bad = with_positions(payload, header, positions)
    if says is None:
        target = base.clone()
        apply_delta(target, header, bad)
        assert target.nonzero().view(-1).tolist() == [3, 70, 71, 200, 290]
        return
    assert says in str(refused(base, header, bad))


def bitmask_delta() -> tuple[torch.Tensor, DeltaHeader, torch.Tensor]:
    base = torch.zeros(300, dtype=torch.float32)  # chunks of 64: the last holds 44 elements
    new = base.clone()
    new[torch.arange(0, 300, 3)] = 2.0  # a third of each chunk: bitmasks
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    assert set(delta.header.kinds.tolist()) == {BITMASK}
    return base, delta.header, delta.payload.clone()


def test_a_bitmask_that_disagrees_with_its_count_or_sets_bits_past_the_end_is_refused() -> None:
    base, header, payload = bitmask_delta()
    at, n = header.sections.bitmask
    miscounted = payload.clone()
    miscounted[at] ^= 2
    assert "set bits differ" in str(refused(base, header, miscounted))
    past_end = payload.clone()
    past_end[at + n - 1] |= 0x08  # element 44 of a 44-element chunk
    assert "past the end" in str(refused(base, header, past_end))


def test_a_bitmask_of_the_wrong_length_is_refused() -> None:
    base, header, payload = bitmask_delta()
    assert "payload of" in str(refused(base, header, payload[:-1]))
    assert "payload of" in str(refused(base, header, torch.cat([payload, payload[-8:]])))
    base, header, payload = positions_delta()  # a positions chunk said to be a bitmask
    raw = bytearray(header.to_bytes())
    raw[table_offset(raw) + 4 * header.nchunks] = BITMASK
    assert isinstance(refused(base, raw, payload), ProtocolError)


# -- fuzz: a plain Python reading of the format as the reference -------------------------


def reference_apply(header: DeltaHeader, payload: bytes, base: list[int]) -> list[int] | None:
    """The new elements (as integers of their width), or None if the payload is invalid."""
    size = header.dtype.itemsize
    ce, kinds, counts = header.chunk_elems, header.kinds.tolist(), header.values.tolist()
    groups = {k: [i for i, kind in enumerate(kinds) if kind == k] for k in (0, 1, 2)}
    lengths = header.chunk_lengths().tolist()
    n_values = sum(counts)
    align = lambda n: -(-n // 8) * 8  # noqa: E731
    n_pos = sum(counts[i] for i in groups[POSITIONS])
    bm_bytes = sum(-(-lengths[i] // 8) for i in groups[BITMASK])
    p_at = align(n_values * size)
    b_at = p_at + align(4 * n_pos)
    if len(payload) != b_at + bm_bytes:
        return None
    code = {1: "B", 2: "H", 4: "I", 8: "Q"}[size]
    values = list(struct.unpack_from(f"<{n_values}{code}", payload, 0))
    positions = list(struct.unpack_from(f"<{n_pos}i", payload, p_at))
    out = list(base)
    v = 0
    for i in groups[POSITIONS]:
        mine = positions[: counts[i]]
        positions = positions[counts[i] :]
        if any(p < 0 or p >= lengths[i] for p in mine) or mine != sorted(set(mine)):
            return None
        for p in mine:
            out[header.start + i * ce + p] = values[v]
            v += 1
    at = b_at
    for i in groups[BITMASK]:
        nbytes = -(-lengths[i] // 8)
        bits = [(payload[at + j // 8] >> (7 - j % 8)) & 1 for j in range(nbytes * 8)]
        at += nbytes
        if any(bits[lengths[i] :]) or sum(bits) != counts[i]:
            return None
        for j, bit in enumerate(bits[: lengths[i]]):
            if bit:
                out[header.start + i * ce + j] = values[v]
                v += 1
    for i in groups[DENSE]:
        for j in range(lengths[i]):
            out[header.start + i * ce + j] = values[v]
            v += 1
    return out


def as_unsigned(t: torch.Tensor) -> list[int]:
    size = t.dtype.itemsize
    return [x % (1 << (8 * size)) for x in flat_bits(t).tolist()]


Mutation = Callable[[random.Random, bytearray, bytearray], tuple[bytearray, bytearray]]


def flip_header(rng: random.Random, h: bytearray, p: bytearray) -> tuple[bytearray, bytearray]:
    for _ in range(rng.randint(1, 3)):
        h[rng.randrange(len(h))] = rng.randrange(256)
    return h, p


def flip_table(rng: random.Random, h: bytearray, p: bytearray) -> tuple[bytearray, bytearray]:
    at = table_offset(h)
    if len(h) > at:
        h[rng.randrange(at, len(h))] = rng.choice([0, 1, 2, 3, rng.randrange(256)])
    return h, p


def flip_payload(rng: random.Random, h: bytearray, p: bytearray) -> tuple[bytearray, bytearray]:
    for _ in range(rng.randint(1, 4)):
        if p:
            p[rng.randrange(len(p))] = rng.randrange(256)
    return h, p


def resize_payload(rng: random.Random, h: bytearray, p: bytearray) -> tuple[bytearray, bytearray]:
    if rng.random() < 0.5 and p:
        return h, p[: rng.randrange(len(p))]
    return h, p + bytearray(rng.randrange(256) for _ in range(rng.randint(1, 16)))


def random_bytes(rng: random.Random, h: bytearray, p: bytearray) -> tuple[bytearray, bytearray]:
    keep = h[: rng.choice([0, 4, 8, FIXED])]  # sometimes a valid magic and format
    tail = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 80)))
    return keep + tail, bytearray(rng.randrange(256) for _ in range(rng.randint(0, 64)))


MUTATIONS: list[Mutation] = [flip_header, flip_table, flip_payload, resize_payload, random_bytes]


def bytes_tensor(raw: bytearray) -> torch.Tensor:
    return torch.tensor(list(raw), dtype=torch.uint8)


def reference(h: bytearray, p: bytearray, base: torch.Tensor, case: int) -> list[int] | None:
    """What the reference makes of a delta: the new elements, or None if it is invalid."""
    try:
        parsed = DeltaHeader.from_bytes(h, tensor="w", version=case)
        parsed.check_fits(base, tensor="w", version=case)
    except AiosyncError:
        return None
    return reference_apply(parsed, bytes(p), as_unsigned(base))


def test_fuzzed_deltas_are_refused_cleanly_or_applied_as_the_format_says() -> None:
    rng = random.Random(2028)
    cases = {"refused": 0, "applied": 0}
    sources = [
        encoded(density, n=n, dtype=dtype, seed=seed)
        for seed, (density, n, dtype) in enumerate(
            [
                (0.02, 300, torch.bfloat16),
                (0.3, 300, torch.bfloat16),
                (1.0, 200, torch.bfloat16),
                (0.05, 257, torch.float32),
                (0.5, 100, torch.uint8),
                (0.01, 500, torch.int64),
            ]
        )
    ]
    for case in range(3000):
        base, header, payload = sources[case % len(sources)]
        h, p = rng.choice(MUTATIONS)(rng, bytearray(header), bytearray(payload.numpy().tobytes()))
        target = base.clone()
        error: AiosyncError | None = None
        try:
            apply_delta(target, h, bytes_tensor(p), tensor="w", version=case)
        except AiosyncError as exc:
            error = exc
        expected = reference(h, p, base, case)
        if error is not None:
            assert torch.equal(flat_bits(target), flat_bits(base)), f"case {case} wrote the base"
            assert error.version == case
            assert expected is None, f"case {case}: refused a valid delta: {error}"
            cases["refused"] += 1
        else:
            assert as_unsigned(target) == expected, f"case {case}"
            cases["applied"] += 1
    assert cases["refused"] > 1000
    assert cases["applied"] > 200
