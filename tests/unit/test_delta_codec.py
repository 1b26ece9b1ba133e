"""Deltas round trip bit for bit, each chunk in its smallest encoding (aiosync.delta)."""

from __future__ import annotations

import numpy
import pytest
import torch

from aiosync.core.errors import MismatchError, UsageError
from aiosync.delta import BITMASK, DENSE, POSITIONS, DeltaHeader, apply_delta, encode_delta
from aiosync.delta.encode import encode_tensors
from aiosync.delta.format import (
    chunk_elems_for,
    encoding_bytes,
    header_nbytes,
    max_payload_bytes,
)
from aiosync.delta.ops import flat_bits
from tests.helpers.deltas import changed_copy, random_tensor

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.uint8,
    torch.int8,
    torch.bool,
]
DENSITIES = [0.0, 1e-4, 0.03, 0.3, 1.0]
CHUNK = 4096  # bytes: several chunks per tensor, the last one short


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat_bits(a), flat_bits(b))


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_delta_applied_to_its_base_gives_the_new_version_bit_for_bit(
    dtype: torch.dtype, density: float
) -> None:
    base = random_tensor((3, 7001), dtype, seed=1)
    new, where = changed_copy(base, density, seed=2)
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    assert delta.changed == len(where)
    target = base.clone()
    apply_delta(target, delta.header.to_bytes(), delta.payload, tensor="w", version=3)
    assert same_bits(target, new)
    assert not same_bits(base, new) or density == 0.0


def test_signed_zeros_and_nan_payloads_travel_exactly() -> None:
    base = torch.tensor([0.0, float("nan"), 1.0, -0.0] * 1000, dtype=torch.float32)
    new = base.clone()
    bits = flat_bits(new)
    bits[0] = bits[0] ^ (1 << 31)  # 0.0 -> -0.0
    bits[1] = bits[1] ^ 1  # another NaN payload
    bits[3] = bits[3] ^ (1 << 31)  # -0.0 -> 0.0
    delta = encode_delta(new, base)
    assert delta.changed == 3
    target = base.clone()
    apply_delta(target, delta.header, delta.payload)
    assert same_bits(target, new)


def chunk_kinds(changed_per_chunk: list[int], dtype: torch.dtype) -> list[int]:
    ce = chunk_elems_for(dtype, CHUNK)
    base = torch.zeros(ce * len(changed_per_chunk), dtype=dtype)
    new = base.clone()
    for i, k in enumerate(changed_per_chunk):
        new[i * ce : i * ce + k] = 1
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    target = base.clone()
    apply_delta(target, delta.header, delta.payload)
    assert torch.equal(target, new)
    return delta.header.kinds.tolist()


def test_each_chunk_takes_the_smallest_encoding_for_its_own_density() -> None:
    # bf16 chunks of 2048: positions cost 6k, a bitmask 256 + 2k, dense 4096 bytes
    assert chunk_kinds([0, 1, 63, 64, 65, 1919, 1920, 2048], torch.bfloat16) == [
        POSITIONS,  # nothing changed: nothing sent
        POSITIONS,
        POSITIONS,
        POSITIONS,  # 384 = 384: the first of equals
        BITMASK,
        BITMASK,
        BITMASK,  # 4096 = 4096
        DENSE,
    ]
    # fp32 chunks of 1024: positions 8k, a bitmask 128 + 4k, dense 4096
    assert chunk_kinds([31, 33, 991, 993], torch.float32) == [POSITIONS, BITMASK, BITMASK, DENSE]


@pytest.mark.parametrize("density", DENSITIES)
def test_the_chosen_encodings_follow_the_measured_density(density: float) -> None:
    base = random_tensor((200_000,), torch.bfloat16, seed=3)
    new, _ = changed_copy(base, density, seed=4)
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    header = delta.header
    changed = (flat_bits(new) != flat_bits(base)).to(torch.int64)
    per_chunk = numpy.array([int(c.sum()) for c in changed.split(header.chunk_elems)])
    costs = numpy.stack(encoding_bytes(header.chunk_lengths(), per_chunk, 2))
    assert numpy.array_equal(header.kinds, costs.argmin(0))
    kinds = delta.chunks_by_kind()
    expected = {0.0: "positions", 1e-4: "positions", 0.3: "bitmask", 1.0: "dense"}
    if density in expected:
        assert kinds[expected[density]] == header.nchunks
    assert delta.nbytes <= header_nbytes(header) + max_payload_bytes(header.count, header.dtype)
    if density == 0.0:
        assert delta.payload.numel() == 0


def test_a_four_percent_bf16_step_takes_about_a_tenth_of_the_dense_bytes() -> None:
    base = random_tensor((1 << 20,), torch.bfloat16, seed=5)
    new, _ = changed_copy(base, 0.04, seed=6)
    delta = encode_delta(new, base)  # 1 MiB chunks
    assert delta.chunks_by_kind()["bitmask"] == delta.header.nchunks
    assert 0.10 < delta.nbytes / delta.dense_nbytes < 0.11  # 1/16 + 0.04, plus the header


def test_a_tensor_encoded_in_spans_applies_span_by_span() -> None:
    base = random_tensor((50_000,), torch.float32, seed=7)
    new, _ = changed_copy(base, 0.05, seed=8)
    ce = chunk_elems_for(torch.float32, CHUNK)
    target = base.clone()
    first = encode_delta(new, base, chunk_bytes=CHUNK, count=5 * ce)
    rest = encode_delta(new, base, chunk_bytes=CHUNK, start=5 * ce)
    assert (first.header.start, rest.header.start) == (0, 5 * ce)
    for part in (rest, first):
        apply_delta(target, part.header.to_bytes(), part.payload)
    assert same_bits(target, new)
    with pytest.raises(UsageError):
        encode_delta(new, base, chunk_bytes=CHUNK, start=ce // 2)
    with pytest.raises(UsageError):
        encode_delta(new, base, chunk_bytes=CHUNK, count=ce + 8)


def test_the_payload_is_written_into_the_buffer_the_caller_gives() -> None:
    base = random_tensor((30_000,), torch.bfloat16, seed=9)
    new, _ = changed_copy(base, 0.2, seed=10)
    buffer = torch.full((8 + max_payload_bytes(base.numel(), base.dtype),), 7, dtype=torch.uint8)
    delta = encode_delta(new, base, chunk_bytes=CHUNK, out=buffer[8:])
    assert delta.payload.data_ptr() == buffer[8:].data_ptr()
    assert torch.equal(delta.payload, encode_delta(new, base, chunk_bytes=CHUNK).payload)
    target = base.clone()
    apply_delta(target, delta.header, delta.payload)
    assert same_bits(target, new)
    with pytest.raises(UsageError, match="aligned"):
        encode_delta(new, base, chunk_bytes=CHUNK, out=buffer[4:])
    with pytest.raises(UsageError, match="hold"):
        encode_delta(new, base, chunk_bytes=CHUNK, out=buffer[8:16])


def test_encoding_many_tensors_ahead_gives_the_same_deltas() -> None:
    pairs = []
    for i, shape in enumerate([(5,), (4096, 3), (0,), (70_001,)]):
        base = random_tensor(shape, torch.float16, seed=20 + i)
        pairs.append((changed_copy(base, 0.1, seed=30 + i)[0], base))
    outs = [torch.empty(max_payload_bytes(b.numel(), b.dtype), dtype=torch.uint8) for _, b in pairs]
    ahead = list(encode_tensors(pairs, outs, chunk_bytes=CHUNK))
    assert len(ahead) == len(pairs)
    for (new, base), delta, out in zip(pairs, ahead, outs, strict=True):
        one = encode_delta(new, base, chunk_bytes=CHUNK)
        assert delta.header.to_bytes() == one.header.to_bytes()
        assert torch.equal(delta.payload, one.payload)
        assert delta.payload.numel() == 0 or delta.payload.data_ptr() == out.data_ptr()


def test_a_header_reads_back_as_written() -> None:
    base = random_tensor((3, 5000), torch.bfloat16, seed=11)
    new, _ = changed_copy(base, 0.3, seed=12)
    header = encode_delta(new, base, chunk_bytes=CHUNK).header
    raw = header.to_bytes()
    assert len(raw) == header_nbytes(header)
    back = DeltaHeader.from_bytes(raw, tensor="w", version=1)
    assert (back.dtype, back.shape, back.chunk_elems, back.start, back.count) == (
        header.dtype,
        header.shape,
        header.chunk_elems,
        header.start,
        header.count,
    )
    assert numpy.array_equal(back.kinds, header.kinds)
    assert numpy.array_equal(back.values, header.values)


def test_a_strided_version_is_diffed_in_its_logical_order() -> None:
    base = random_tensor((300, 200), torch.float32, seed=13)
    new = (changed_copy(base, 0.1, seed=14)[0]).t().contiguous().t()  # same values, strided
    assert not new.is_contiguous()
    delta = encode_delta(new, base, chunk_bytes=CHUNK)
    target = base.clone()
    apply_delta(target, delta.header, delta.payload)
    assert same_bits(target, new.contiguous())


def test_versions_that_cannot_be_diffed_are_refused() -> None:
    base = torch.zeros(10)
    with pytest.raises(MismatchError):
        encode_delta(torch.zeros(10, dtype=torch.float64), base, tensor="w")
    with pytest.raises(MismatchError):
        encode_delta(torch.zeros(11), base)
    wide = torch.zeros(10, dtype=torch.complex128)
    with pytest.raises(MismatchError, match="dense"):
        encode_delta(wide, wide.clone())
