"""Behaviour tests for the pure byte layout layer (:mod:`aiosync.layout`).

Everything here is in-memory: tensors go into planning/packing, and what comes out (bucket
plans, specs, buffer bytes, views, errors) is checked. No processes, sockets or GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.layout import (
    ALIGNMENT,
    BucketPlan,
    TensorSpec,
    calculate_aligned_size,
    dtype_from_name,
    dtype_name,
    iter_named_tensor_buckets,
    materialize,
    pack_bucket,
    plan_buckets,
    validate_specs,
    view_spec,
)

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's values in logical (row-major) order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert raw_bytes(got) == raw_bytes(want)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FakeAsync:
    """Stands in for an async collective result (e.g. a DTensor redistribute handle)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.waited = 0

    def wait(self) -> torch.Tensor:
        self.waited += 1
        return self._tensor


class WaitableTensor(torch.Tensor):
    """A torch.Tensor subclass with a ``wait()`` (like AsyncCollectiveTensor)."""

    def wait(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def f32(n: int, fill: float | None = None) -> torch.Tensor:
    if fill is None:
        return torch.arange(n, dtype=torch.float32)
    return torch.full((n,), fill, dtype=torch.float32)


def collect(plans: Iterator[BucketPlan], capacity: int) -> dict[str, torch.Tensor]:
    """Pack each plan into one reused buffer and reassemble every tensor from the views.

    The buffer is filled with garbage before each pack, as a reused buffer would be.
    """
    buffer = torch.empty(capacity, dtype=torch.uint8)
    whole: dict[str, torch.Tensor] = {}
    chunks: dict[str, list[torch.Tensor]] = {}
    spec_of: dict[str, TensorSpec] = {}
    for plan in plans:
        assert plan.used <= capacity
        validate_specs(plan.specs, plan.used, capacity)
        buffer.fill_(0xA5)
        pack_bucket(buffer, plan)
        for spec in plan.specs:
            view = view_spec(buffer, spec)
            if spec.is_whole:
                assert spec.name not in whole
                whole[spec.name] = view.clone()
            else:
                parts = chunks.setdefault(spec.name, [])
                assert spec.start == sum(p.numel() for p in parts)
                parts.append(view.clone())
                spec_of[spec.name] = spec
    for name, parts in chunks.items():
        spec = spec_of[name]
        flat = torch.cat(parts)
        assert flat.numel() == spec.total_nbytes
        whole[name] = flat.view(dtype_from_name(spec.dtype)).view(spec.shape)
    return whole


# --------------------------------------------------------------------------------------
# calculate_aligned_size
# --------------------------------------------------------------------------------------


def test_alignment_default_is_512() -> None:
    assert ALIGNMENT == 512
    assert calculate_aligned_size(1) == 512


@pytest.mark.parametrize(
    ("size", "expected"),
    [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (1024, 1024), (1025, 1536)],
)
def test_aligned_size_default_alignment(size: int, expected: int) -> None:
    assert calculate_aligned_size(size) == expected


@pytest.mark.parametrize(
    ("size", "alignment", "expected"),
    [
        (0, 8, 0),
        (1, 8, 8),
        (8, 8, 8),
        (9, 8, 16),
        (5, 1, 5),
        (100, 3, 102),
        (4096, 4096, 4096),
        (4097, 4096, 8192),
        (10**12 + 1, 512, (10**12 // 512 + 1) * 512),
    ],
)
def test_aligned_size_custom_alignment(size: int, alignment: int, expected: int) -> None:
    assert calculate_aligned_size(size, alignment) == expected


@pytest.mark.parametrize("multiple", [0, 1, 2, 7, 1000])
def test_exact_multiples_unchanged(multiple: int) -> None:
    assert calculate_aligned_size(multiple * 512) == multiple * 512
    assert calculate_aligned_size(multiple * 64, 64) == multiple * 64


@given(st.integers(0, 10**9), st.integers(1, 10**5))
def test_aligned_size_properties(size: int, alignment: int) -> None:
    got = calculate_aligned_size(size, alignment)
    assert got % alignment == 0
    assert size <= got < size + alignment


@pytest.mark.parametrize("alignment", [0, -1, -512])
def test_aligned_size_rejects_nonpositive_alignment(alignment: int) -> None:
    with pytest.raises(ValueError, match="alignment"):
        calculate_aligned_size(100, alignment)


@pytest.mark.parametrize("size", [-1, -512, -(10**9)])
def test_aligned_size_rejects_negative_size(size: int) -> None:
    with pytest.raises(ValueError, match="size"):
        calculate_aligned_size(size)


# --------------------------------------------------------------------------------------
# iter_named_tensor_buckets
# --------------------------------------------------------------------------------------


def bucket_names(buckets: list[list[tuple[str, torch.Tensor]]]) -> list[list[str]]:
    return [[name for name, _ in bucket] for bucket in buckets]


def test_buckets_group_up_to_limit() -> None:
    # 40 bytes each, limit 100: two fit (80), a third would go over (120).
    params = [(f"t{i}", f32(10)) for i in range(5)]
    buckets = list(iter_named_tensor_buckets(params, 100))
    assert bucket_names(buckets) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    for bucket in buckets:
        assert sum(nbytes_of(t) for _, t in bucket) <= 100


def test_bucket_filled_exactly_to_limit_stays_one_bucket() -> None:
    params = [("a", f32(10)), ("b", f32(15))]  # 40 + 60 == 100
    buckets = list(iter_named_tensor_buckets(params, 100))
    assert bucket_names(buckets) == [["a", "b"]]


def test_new_bucket_when_one_byte_over() -> None:
    params = [("a", f32(10)), ("b", torch.zeros(61, dtype=torch.uint8))]  # 40 + 61 > 100
    buckets = list(iter_named_tensor_buckets(params, 100))
    assert bucket_names(buckets) == [["a"], ["b"]]


def test_oversized_tensor_travels_alone() -> None:
    params = [("small0", f32(2)), ("big", f32(100)), ("small1", f32(2)), ("small2", f32(2))]
    buckets = list(iter_named_tensor_buckets(params, 64))
    assert bucket_names(buckets) == [["small0"], ["big"], ["small1", "small2"]]


def test_oversized_tensor_first_and_last() -> None:
    params = [("big0", f32(100)), ("big1", f32(100))]
    assert bucket_names(list(iter_named_tensor_buckets(params, 64))) == [["big0"], ["big1"]]


def test_zero_size_tensor_after_oversized_does_not_join_it() -> None:
    params = [("big", f32(100)), ("empty", torch.empty(0))]
    buckets = list(iter_named_tensor_buckets(params, 64))
    assert bucket_names(buckets) == [["big"], ["empty"]]


def test_zero_size_tensors_share_a_bucket() -> None:
    params = [("a", f32(16)), ("e0", torch.empty(0)), ("e1", torch.empty(0, 3))]
    buckets = list(iter_named_tensor_buckets(params, 64))
    assert bucket_names(buckets) == [["a", "e0", "e1"]]


def test_bucket_order_and_identity_kept() -> None:
    tensors = [(f"w{i}", torch.full((i + 1,), float(i))) for i in range(20)]
    buckets = list(iter_named_tensor_buckets(iter(tensors), 24))
    flat = [pair for bucket in buckets for pair in bucket]
    assert [n for n, _ in flat] == [n for n, _ in tensors]
    for (_, got), (_, want) in zip(flat, tensors, strict=True):
        assert got is want
    for bucket in buckets:
        size = sum(nbytes_of(t) for _, t in bucket)
        assert size <= 24 or len(bucket) == 1


def test_bucket_sizes_use_element_size() -> None:
    # 8 int64 == 64 bytes, 64 int8 == 64 bytes, 32 bf16 == 64 bytes
    params = [
        ("i64", torch.zeros(8, dtype=torch.int64)),
        ("i8", torch.zeros(64, dtype=torch.int8)),
        ("bf16", torch.zeros(32, dtype=torch.bfloat16)),
    ]
    assert bucket_names(list(iter_named_tensor_buckets(params, 128))) == [["i64", "i8"], ["bf16"]]


def test_empty_input_yields_nothing() -> None:
    assert list(iter_named_tensor_buckets([], 100)) == []


def test_async_results_are_waited_and_materialised() -> None:
    fakes = [FakeAsync(f32(10, float(i))) for i in range(3)]
    params = [(f"t{i}", fake) for i, fake in enumerate(fakes)]
    buckets = list(iter_named_tensor_buckets(params, 80))
    assert bucket_names(buckets) == [["t0", "t1"], ["t2"]]
    for fake in fakes:
        assert fake.waited == 1
    for bucket in buckets:
        for name, tensor in bucket:
            assert type(tensor) is torch.Tensor
            assert torch.equal(tensor, f32(10, float(int(name[1:]))))


def test_sizing_uses_the_waited_tensor() -> None:
    # The wrapper itself has no size; only the awaited tensor does (50 floats == 200 bytes).
    params = [("a", FakeAsync(f32(50))), ("b", FakeAsync(f32(1)))]
    assert bucket_names(list(iter_named_tensor_buckets(params, 100))) == [["a"], ["b"]]


def test_tensor_subclass_with_wait_is_resolved() -> None:
    waitable = torch.arange(4.0).as_subclass(WaitableTensor)
    buckets = list(iter_named_tensor_buckets([("w", waitable), ("p", f32(2))], 1000))
    (bucket,) = buckets
    assert type(bucket[0][1]) is torch.Tensor
    assert torch.equal(bucket[0][1], torch.arange(4.0))
    assert type(bucket[1][1]) is torch.Tensor


def test_wait_returning_non_tensor_is_type_error() -> None:
    class Bad:
        def wait(self) -> str:
            return "nope"

    with pytest.raises(TypeError):
        list(iter_named_tensor_buckets([("bad", Bad())], 100))  # type: ignore[list-item]


def test_materialize_plain_tensor_is_identity() -> None:
    t = f32(3)
    assert materialize(t) is t
    with pytest.raises(TypeError, match="list"):
        materialize([1, 2, 3])


@pytest.mark.parametrize("size", [0, -1, -100])
def test_buckets_reject_nonpositive_size(size: int) -> None:
    with pytest.raises(ValueError, match="buffer_size_bytes"):
        iter_named_tensor_buckets([("a", f32(1))], size)


def test_buckets_nonpositive_size_raises_before_consuming_input() -> None:
    consumed: list[str] = []

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        consumed.append("a")
        yield "a", f32(1)

    with pytest.raises(ValueError, match="buffer_size_bytes"):
        iter_named_tensor_buckets(gen(), 0)
    assert consumed == []


def test_buckets_are_lazy() -> None:
    pulled: list[str] = []
    waited: list[str] = []

    class Recording(FakeAsync):
        def __init__(self, name: str) -> None:
            super().__init__(f32(10))
            self.name = name

        def wait(self) -> torch.Tensor:
            waited.append(self.name)
            return super().wait()

    def gen() -> Iterator[tuple[str, Recording]]:
        for i in range(6):
            pulled.append(f"t{i}")
            yield f"t{i}", Recording(f"t{i}")

    it = iter(iter_named_tensor_buckets(gen(), 80))  # two 40-byte tensors per bucket
    assert pulled == []
    assert waited == []
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1"]
    # Only what was needed to close the first bucket has been pulled (t2 told us it was full).
    assert pulled == ["t0", "t1", "t2"]
    assert waited == ["t0", "t1", "t2"]
    rest = list(it)
    assert bucket_names(rest) == [["t2", "t3"], ["t4", "t5"]]
    assert len(pulled) == 6


# --------------------------------------------------------------------------------------
# dtype names and TensorSpec
# --------------------------------------------------------------------------------------

STREAMABLE = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", STREAMABLE)
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    name = dtype_name(dtype)
    assert isinstance(name, str)
    assert dtype_from_name(name) is dtype


def test_dtype_name_examples() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bool) == "bool"


def test_unstreamable_dtype_is_value_error() -> None:
    with pytest.raises(ValueError, match="cannot be streamed"):
        dtype_name(torch.uint16)


@pytest.mark.parametrize("name", ["float", "torch.float32", "", "Float32", "pickle"])
def test_unknown_dtype_name_is_protocol_error(name: str) -> None:
    with pytest.raises(ProtocolError, match="unknown dtype"):
        dtype_from_name(name)


def test_spec_properties_whole_and_chunks() -> None:
    whole = TensorSpec("w", "float32", (4, 8), 0, 128)
    assert whole.total_nbytes == 128
    assert whole.is_whole
    assert whole.is_last_chunk
    first = TensorSpec("w", "float32", (4, 8), 0, 64, 0)
    last = TensorSpec("w", "float32", (4, 8), 0, 64, 64)
    assert not first.is_whole
    assert not first.is_last_chunk
    assert not last.is_whole
    assert last.is_last_chunk
    scalar = TensorSpec("s", "int64", (), 0, 8)
    assert scalar.total_nbytes == 8
    assert scalar.is_whole
    empty = TensorSpec("e", "bfloat16", (0, 5), 0, 0)
    assert empty.total_nbytes == 0
    assert empty.is_whole


# --------------------------------------------------------------------------------------
# plan_buckets
# --------------------------------------------------------------------------------------


def test_plan_aligns_offsets() -> None:
    tensors = [("a", f32(1)), ("b", f32(150)), ("c", torch.zeros(3, dtype=torch.int8))]
    (plan,) = list(plan_buckets(tensors, 4096))
    assert [(s.name, s.offset, s.nbytes, s.start) for s in plan.specs] == [
        ("a", 0, 4, 0),
        ("b", 512, 600, 0),
        ("c", 1536, 3, 0),
    ]
    assert plan.used == 2048
    assert plan.payload_bytes == 607
    for spec in plan.specs:
        assert spec.offset % ALIGNMENT == 0


def test_plan_records_dtype_and_shape() -> None:
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    (plan,) = list(plan_buckets([("x", t)], 512))
    (spec,) = plan.specs
    assert spec == TensorSpec("x", "bfloat16", (3, 5), 0, 30, 0)
    assert plan.tensors[0] is t


def test_plan_respects_capacity() -> None:
    # each tensor takes one 512-byte slot; capacity of 3 slots
    tensors = [(f"t{i}", f32(100)) for i in range(7)]
    plans = list(plan_buckets(tensors, 1536))
    assert [[s.name for s in p.specs] for p in plans] == [
        ["t0", "t1", "t2"],
        ["t3", "t4", "t5"],
        ["t6"],
    ]
    for plan in plans:
        assert plan.used <= 1536
        assert [s.offset for s in plan.specs] == [512 * i for i in range(len(plan.specs))]


def test_plan_new_bucket_when_aligned_size_would_overflow() -> None:
    # 300 bytes (aligned 512) + 513 bytes (aligned 1024) = 1536 > 1024
    tensors = [
        ("a", torch.zeros(300, dtype=torch.uint8)),
        ("b", torch.zeros(513, dtype=torch.uint8)),
    ]
    plans = list(plan_buckets(tensors, 1024))
    assert [[s.name for s in p.specs] for p in plans] == [["a"], ["b"]]
    assert [p.used for p in plans] == [512, 1024]
    assert plans[1].specs[0].offset == 0


def test_plan_tensor_exactly_capacity_not_chunked() -> None:
    (plan,) = list(plan_buckets([("a", f32(256))], 1024))
    (spec,) = plan.specs
    assert spec.is_whole
    assert spec.nbytes == 1024
    assert plan.used == 1024


def test_plan_chunks_tensor_larger_than_capacity() -> None:
    big = f32(625)  # 2500 bytes
    tensors = [("before", f32(4)), ("big", big), ("after", f32(4))]
    plans = list(plan_buckets(tensors, 1024))
    names = [[s.name for s in p.specs] for p in plans]
    assert names == [["before"], ["big"], ["big"], ["big"], ["after"]]
    chunks = [p.specs[0] for p in plans[1:4]]
    assert [(c.start, c.nbytes, c.offset) for c in chunks] == [
        (0, 1024, 0),
        (1024, 1024, 0),
        (2048, 452, 0),
    ]
    assert [p.used for p in plans[1:4]] == [1024, 1024, 512]
    for chunk in chunks:
        assert chunk.dtype == "float32"
        assert chunk.shape == (625,)
        assert not chunk.is_whole
    assert [c.is_last_chunk for c in chunks] == [False, False, True]
    starts = [c.start for c in chunks]
    assert starts == sorted(starts)
    assert len(set(starts)) == len(starts)
    # consecutive byte ranges covering the tensor exactly
    pos = 0
    for c in chunks:
        assert c.start == pos
        pos += c.nbytes
    assert pos == 2500
    for plan in plans:
        assert plan.used <= 1024


def test_plan_chunk_count_exact_multiple() -> None:
    plans = list(plan_buckets([("big", f32(1024))], 1024))  # 4096 bytes -> 4 full chunks
    assert [(p.specs[0].start, p.specs[0].nbytes) for p in plans] == [
        (0, 1024),
        (1024, 1024),
        (2048, 1024),
        (3072, 1024),
    ]


@pytest.mark.parametrize("second", ["a", "b"])
def test_plan_rejects_duplicate_names(second: str) -> None:
    tensors = [("a", f32(1)), ("b", f32(1)), (second, f32(1))]
    with pytest.raises(ValueError, match="twice"):
        list(plan_buckets(tensors, 4096))


def test_plan_rejects_duplicate_across_buckets() -> None:
    tensors = [("a", f32(200)), ("b", f32(200)), ("a", f32(1))]
    with pytest.raises(ValueError, match="'a'"):
        list(plan_buckets(tensors, 1024))


@pytest.mark.parametrize("capacity", [0, -512, 1, 100, 511, 513, 1000, 1536 + 1])
def test_plan_rejects_bad_capacity(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        list(plan_buckets([("a", f32(1))], capacity))


@pytest.mark.parametrize("capacity", [512, 1024, 1536, 1 << 20])
def test_plan_accepts_aligned_capacity(capacity: int) -> None:
    plans = list(plan_buckets([("a", f32(1))], capacity))
    assert len(plans) == 1


def test_plan_empty_input() -> None:
    assert list(plan_buckets([], 1024)) == []


def test_plan_zero_size_tensor_takes_no_room() -> None:
    tensors = [("a", f32(128)), ("e", torch.empty(0, 4)), ("b", f32(128))]
    (plan,) = list(plan_buckets(tensors, 1024))
    assert [(s.name, s.offset, s.nbytes) for s in plan.specs] == [
        ("a", 0, 512),
        ("e", 512, 0),
        ("b", 512, 512),
    ]
    validate_specs(plan.specs, plan.used, 1024)


def test_plan_materialises_async_results() -> None:
    fake = FakeAsync(f32(3))
    (plan,) = list(plan_buckets([("a", fake)], 512))
    assert fake.waited == 1
    assert type(plan.tensors[0]) is torch.Tensor
    assert plan.specs[0].shape == (3,)


def test_plan_rejects_unstreamable_dtype() -> None:
    with pytest.raises(ValueError, match="cannot be streamed"):
        list(plan_buckets([("u", torch.zeros(3, dtype=torch.uint16))], 512))


def test_plan_is_lazy() -> None:
    pulled: list[str] = []

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(10):
            pulled.append(f"t{i}")
            yield f"t{i}", f32(128)  # one full 512 slot

    it = plan_buckets(gen(), 1024)
    assert pulled == []
    first = next(it)
    assert [s.name for s in first.specs] == ["t0", "t1"]
    assert len(pulled) < 10


# --------------------------------------------------------------------------------------
# pack_bucket + view_spec
# --------------------------------------------------------------------------------------


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.5])
    return [
        ("f32", torch.randn(7, 3, generator=g)),
        ("f32_special", special),
        ("bf16", torch.randn(5, 11, generator=g).to(torch.bfloat16)),
        ("f16", torch.randn(13, generator=g).to(torch.float16)),
        ("f16_special", special.to(torch.float16)),
        ("i64", torch.randint(-(2**62), 2**62, (6,), generator=g, dtype=torch.int64)),
        ("i8", torch.randint(-128, 128, (33,), generator=g, dtype=torch.int8)),
        ("bool", torch.rand(17, generator=g) > 0.5),
        ("scalar", torch.tensor(2.75)),
        ("scalar_i64", torch.tensor(-(2**40), dtype=torch.int64)),
        ("empty", torch.empty(0, dtype=torch.float32)),
        ("empty_2d", torch.empty(3, 0, dtype=torch.bfloat16)),
        ("f64", torch.randn(2, 2, 2, generator=g, dtype=torch.float64)),
        ("c64", torch.randn(4, generator=g, dtype=torch.complex64)),
        ("u8", torch.arange(256, dtype=torch.uint8)),
    ]


def test_pack_view_round_trip_mixed_dtypes_one_buffer() -> None:
    tensors = mixed_tensors()
    plans = list(plan_buckets(tensors, 1 << 16))
    assert len(plans) == 1
    (plan,) = plans
    buffer = torch.full((1 << 16,), 0x5A, dtype=torch.uint8)
    pack_bucket(buffer, plan)
    validate_specs(plan.specs, plan.used, buffer.numel())
    assert [s.name for s in plan.specs] == [n for n, _ in tensors]
    for (_, want), spec in zip(tensors, plan.specs, strict=True):
        got = view_spec(buffer, spec)
        assert_bit_exact(got, want)


def test_pack_view_round_trip_mixed_dtypes_many_buckets() -> None:
    tensors = mixed_tensors()
    got = collect(plan_buckets(tensors, 1024), 1024)
    assert set(got) == {n for n, _ in tensors}
    for name, want in tensors:
        assert_bit_exact(got[name], want)


def test_view_of_whole_tensor_has_dtype_and_shape() -> None:
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    (plan,) = list(plan_buckets([("t", t)], 512))
    buffer = torch.zeros(512, dtype=torch.uint8)
    pack_bucket(buffer, plan)
    view = view_spec(buffer, plan.specs[0])
    assert view.dtype == torch.int16
    assert view.shape == (3, 4)
    assert torch.equal(view, t)


def test_view_of_chunk_is_flat_uint8() -> None:
    plans = list(plan_buckets([("big", f32(300))], 512))
    buffer = torch.zeros(512, dtype=torch.uint8)
    pack_bucket(buffer, plans[0])
    view = view_spec(buffer, plans[0].specs[0])
    assert view.dtype == torch.uint8
    assert view.shape == (512,)
    assert view.numpy().tobytes() == raw_bytes(f32(300))[:512]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.arange(24.0).reshape(4, 6).t(), id="transposed"),
        pytest.param(lambda: torch.arange(40.0).reshape(5, 8)[:, 1:7:2], id="sliced_step"),
        pytest.param(lambda: torch.arange(30, dtype=torch.int64)[::3], id="strided_1d"),
        pytest.param(lambda: torch.arange(3.0).expand(4, 3), id="expanded"),
        pytest.param(
            lambda: torch.arange(60, dtype=torch.int16).reshape(3, 4, 5).permute(2, 0, 1),
            id="permuted",
        ),
        pytest.param(lambda: (torch.arange(20) % 3 == 0).reshape(4, 5).t(), id="bool_t"),
        pytest.param(
            lambda: (
                torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
                .to(torch.bfloat16)
                .t()[1:5]
            ),
            id="bf16_t_sliced",
        ),
        pytest.param(lambda: torch.arange(10.0)[4], id="scalar_from_slice"),
    ],
)
def test_pack_non_contiguous_sources(make) -> None:  # type: ignore[no-untyped-def]
    src = make()
    assert src.ndim == 0 or not src.is_contiguous() or src.stride() == ()
    got = collect(plan_buckets([("x", src), ("y", f32(3))], 1024), 1024)
    assert_bit_exact(got["x"], src)
    assert_bit_exact(got["y"], f32(3))


def test_pack_does_not_modify_source() -> None:
    src = torch.arange(24.0).reshape(4, 6).t()
    before = src.clone()
    collect(plan_buckets([("x", src)], 512), 512)
    assert torch.equal(src, before)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.arange(1000, dtype=torch.float32), id="f32"),
        pytest.param(
            lambda: torch.arange(2000, dtype=torch.float32).reshape(40, 50).t(), id="f32_t"
        ),
        pytest.param(
            lambda: torch.randn(33, 47, generator=torch.Generator().manual_seed(3)).to(
                torch.bfloat16
            ),
            id="bf16_odd",
        ),
        pytest.param(lambda: torch.arange(3000, dtype=torch.int64)[::2], id="i64_strided"),
        pytest.param(lambda: torch.arange(1537) % 2 == 1, id="bool"),
        pytest.param(lambda: torch.arange(1025, dtype=torch.uint8), id="u8_one_over"),
    ],
)
@pytest.mark.parametrize("capacity", [512, 1024])
def test_chunked_tensor_reassembles(make, capacity: int) -> None:  # type: ignore[no-untyped-def]
    src = make()
    assert nbytes_of(src) > capacity
    plans = list(plan_buckets([("head", f32(2)), ("big", src), ("tail", f32(2))], capacity))
    chunk_plans = [p for p in plans if p.specs[0].name == "big"]
    assert len(chunk_plans) == -(-nbytes_of(src) // capacity)
    for p in chunk_plans:
        assert len(p.specs) == 1  # a chunk travels alone
    got = collect(iter(plans), capacity)
    assert_bit_exact(got["big"], src)
    assert_bit_exact(got["head"], f32(2))
    assert_bit_exact(got["tail"], f32(2))


def test_chunked_complex_conjugate_view_reassembles() -> None:
    # BUG: pack_bucket's chunk path calls tensor_bytes(), i.e. ``.view(torch.uint8)``, on a
    # lazily-conjugated complex tensor (``.contiguous()`` keeps the conj bit), which raises
    # RuntimeError. The whole-tensor path (copy_) resolves the conjugation correctly.
    src = torch.randn(100, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    src = src.conj()
    assert src.is_conj()
    got = collect(plan_buckets([("c", src)], 512), 512)
    assert_bit_exact(got["c"], src.resolve_conj())


def test_whole_complex_conjugate_view_round_trips() -> None:
    src = torch.randn(10, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)).conj()
    got = collect(plan_buckets([("c", src)], 512), 512)
    assert_bit_exact(got["c"], src.resolve_conj())


def test_views_are_zero_copy() -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    tensors = [
        ("a", f32(10)),
        ("b", torch.zeros(4, 4, dtype=torch.int64)),
        ("c", torch.tensor(1.0)),
    ]
    (plan,) = list(plan_buckets(tensors, 4096))
    pack_bucket(buffer, plan)
    base = buffer.data_ptr()
    for spec in plan.specs:
        view = view_spec(buffer, spec)
        assert view.data_ptr() == base + spec.offset
        assert base <= view.data_ptr()
        assert view.data_ptr() + spec.nbytes <= base + buffer.numel()
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # writes to the buffer show through the view ...
    a_spec = plan.specs[0]
    a = view_spec(buffer, a_spec)
    buffer[a_spec.offset : a_spec.offset + 4].copy_(
        torch.tensor([42.0], dtype=torch.float32).view(torch.uint8)
    )
    assert a[0].item() == 42.0
    # ... and writes to the view show in the buffer
    b_spec = plan.specs[1]
    b = view_spec(buffer, b_spec)
    b[1, 2] = 7
    raw = buffer[b_spec.offset : b_spec.offset + b_spec.nbytes].view(torch.int64)
    assert raw[1 * 4 + 2].item() == 7


def test_chunk_views_are_zero_copy() -> None:
    buffer = torch.zeros(512, dtype=torch.uint8)
    plans = list(plan_buckets([("big", f32(300))], 512))
    pack_bucket(buffer, plans[1])
    view = view_spec(buffer, plans[1].specs[0])
    assert view.data_ptr() == buffer.data_ptr()
    buffer[0] = 0xEE
    assert view[0].item() == 0xEE


def test_pack_leaves_padding_untouched() -> None:
    buffer = torch.full((2048,), 0xCC, dtype=torch.uint8)
    (plan,) = list(plan_buckets([("a", f32(3)), ("b", torch.ones(5, dtype=torch.int8))], 2048))
    pack_bucket(buffer, plan)
    covered = torch.zeros(2048, dtype=torch.bool)
    for spec in plan.specs:
        covered[spec.offset : spec.offset + spec.nbytes] = True
    assert bool((buffer[~covered] == 0xCC).all())


def test_pack_rejects_too_small_buffer() -> None:
    (plan,) = list(plan_buckets([("a", f32(200)), ("b", f32(200))], 2048))
    assert plan.used == 2048
    with pytest.raises(ValueError, match="2048"):
        pack_bucket(torch.zeros(1024, dtype=torch.uint8), plan)


def test_pack_into_larger_buffer_is_fine() -> None:
    (plan,) = list(plan_buckets([("a", f32(5))], 512))
    buffer = torch.zeros(8192, dtype=torch.uint8)
    pack_bucket(buffer, plan)
    assert torch.equal(view_spec(buffer, plan.specs[0]), f32(5))


def test_pack_requires_grad_parameters() -> None:
    p = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(1)))
    got = collect(plan_buckets([("p", p)], 512), 512)  # chunked
    assert_bit_exact(got["p"], p.detach())
    got = collect(plan_buckets([("p", p)], 2048), 2048)  # whole
    assert_bit_exact(got["p"], p.detach())


# --------------------------------------------------------------------------------------
# validate_specs
# --------------------------------------------------------------------------------------


def spec(
    name: str,
    offset: int,
    nbytes: int,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: str = "uint8",
    start: int = 0,
) -> TensorSpec:
    return TensorSpec(name, dtype, shape if shape is not None else (nbytes,), offset, nbytes, start)


def test_validate_accepts_planned_layouts() -> None:
    for plan in plan_buckets([*mixed_tensors(), ("big", f32(1000))], 1024):
        validate_specs(plan.specs, plan.used, 1024)


def test_validate_accepts_empty_bucket() -> None:
    validate_specs([], 0, 512)


def test_validate_accepts_chunk_and_adjacent_specs() -> None:
    validate_specs([spec("a", 0, 512), spec("b", 512, 10)], 1024, 1024)
    validate_specs([spec("c", 0, 100, shape=(1000,), start=300)], 512, 512)
    validate_specs([spec("z", 0, 0), spec("y", 0, 4)], 512, 512)


def assert_protocol_error(
    specs: list[TensorSpec], used: int, capacity: int, tensor: str | None, match: str
) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        validate_specs(specs, used, capacity)
    assert info.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(info.value)
    assert isinstance(info.value, AiosyncError)
    return info.value


@pytest.mark.parametrize("offset", [1, 100, 511, 513, 1000])
def test_validate_rejects_misaligned(offset: int) -> None:
    specs = [spec("ok", 0, 4), spec("bad.weight", offset, 4)]
    assert_protocol_error(specs, 2048, 2048, "bad.weight", "misaligned")


def test_validate_rejects_overlap() -> None:
    specs = [spec("first", 0, 1024), spec("second", 512, 16)]
    assert_protocol_error(specs, 2048, 2048, "second", "overlapping")


def test_validate_rejects_descending_offsets() -> None:
    specs = [spec("first", 1024, 16), spec("second", 0, 16)]
    assert_protocol_error(specs, 2048, 2048, "second", "overlapping")


def test_validate_rejects_same_offset_twice() -> None:
    specs = [spec("first", 0, 16), spec("second", 0, 16)]
    assert_protocol_error(specs, 2048, 2048, "second", "overlapping")


def test_validate_rejects_negative_offset() -> None:
    assert_protocol_error([spec("neg", -512, 16)], 2048, 2048, "neg", "offset")


def test_validate_rejects_range_past_used() -> None:
    assert_protocol_error([spec("a", 0, 16), spec("b", 512, 600)], 1024, 2048, "b", "run past")


def test_validate_rejects_range_past_buffer() -> None:
    # used may equal the buffer's capacity, but nothing may lie beyond it
    assert_protocol_error([spec("edge", 512, 513)], 1024, 1024, "edge", "run past")


@pytest.mark.parametrize(("used", "capacity"), [(1025, 1024), (-1, 1024), (1, 0)])
def test_validate_rejects_bad_used(used: int, capacity: int) -> None:
    assert_protocol_error([], used, capacity, None, "bucket claims")


def test_validate_rejects_range_beyond_tensor() -> None:
    s = spec("w", 0, 20, shape=(4,), dtype="float32")  # 16-byte tensor, 20 bytes claimed
    assert_protocol_error([s], 512, 512, "w", "outside")


def test_validate_rejects_chunk_beyond_tensor() -> None:
    s = spec("w", 0, 512, shape=(256,), dtype="float32", start=768)  # 768 + 512 > 1024
    assert_protocol_error([s], 512, 512, "w", "outside")


def test_validate_rejects_negative_nbytes_and_start() -> None:
    assert_protocol_error([spec("n", 0, -4, shape=(8,))], 512, 512, "n", "outside")
    assert_protocol_error([spec("s", 0, 4, shape=(8,), start=-4)], 512, 512, "s", "outside")


def test_validate_rejects_unknown_dtype() -> None:
    s = TensorSpec("layer.0.weight", "float128", (4,), 0, 64)
    err = assert_protocol_error([spec("ok", 0, 4), s], 1024, 1024, "layer.0.weight", "dtype")
    assert "float128" in str(err)


def test_validate_rejects_negative_dimension() -> None:
    s = TensorSpec("neg", "float32", (-2, -2), 0, 16)  # product is positive: still rejected
    assert_protocol_error([s], 512, 512, "neg", "negative")


# --------------------------------------------------------------------------------------
# property: pack then view reproduces every tensor
# --------------------------------------------------------------------------------------

PROPERTY_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
tensor_descs = st.lists(
    st.tuples(shapes, st.sampled_from(PROPERTY_DTYPES), st.booleans()), min_size=0, max_size=8
)


def make_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, transpose: bool, seed: int
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if transpose and len(shape) >= 2:
        shape = (shape[1], shape[0], *shape[2:])
    numel = 1
    for d in shape:
        numel *= d
    if dtype is torch.bool:
        t = torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).bool()
    else:
        size = torch.empty((), dtype=dtype).element_size()
        t = torch.randint(0, 256, (numel * size,), generator=g, dtype=torch.uint8).view(dtype)
    t = t.reshape(shape)
    if transpose and len(shape) >= 2:
        t = t.transpose(0, 1)
    return t


@given(
    descs=tensor_descs,
    slots=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_pack_then_view_reproduces_tensors(
    descs: list[tuple[tuple[int, ...], torch.dtype, bool]], slots: int, seed: int
) -> None:
    capacity = slots * ALIGNMENT
    tensors = [
        (f"t{i}", make_tensor(shape, dtype, transpose, seed + i))
        for i, (shape, dtype, transpose) in enumerate(descs)
    ]
    plans = list(plan_buckets(tensors, capacity))
    for plan in plans:
        assert plan.used <= capacity
        assert plan.used % ALIGNMENT == 0
        for s in plan.specs:
            assert s.offset % ALIGNMENT == 0
        if any(not s.is_whole for s in plan.specs):
            assert len(plan.specs) == 1
    # order kept: the first appearance of each name follows the input order
    seen: list[str] = []
    for plan in plans:
        for s in plan.specs:
            if s.name not in seen:
                seen.append(s.name)
    assert seen == [n for n, _ in tensors]
    got = collect(iter(plans), capacity)
    assert set(got) == {n for n, _ in tensors}
    for name, want in tensors:
        assert_bit_exact(got[name], want)


@pytest.mark.parametrize(("start", "length"), [(0, 4096), (8, 4088), (3, 1001), (2, 6), (4, 12)])
def test_copy_bytes_is_exact_for_any_alignment(start: int, length: int) -> None:
    from aiosync.core.layout import copy_bytes

    src = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    dst = torch.zeros(8192, dtype=torch.uint8)
    copy_bytes(dst[start : start + length], src[start : start + length])
    assert torch.equal(dst[start : start + length], src[start : start + length])
    assert not dst[:start].any()
    assert not dst[start + length :].any()
