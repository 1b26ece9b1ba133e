"""The per-tensor shortcuts give exactly what the plain paths give, and refuse the same.

- :func:`aiosync.core.planning.lay_out` (manifest and plans in one pass) against
  :func:`build_manifest` and :func:`plan_buckets`;
- packing tiny tensors per dtype in one call (:mod:`aiosync.core.bulk_copy`) against the
  copy per tensor, byte for byte, padding included;
- the engine replaying its last whole stream (:mod:`aiosync.core.stream_state`): an equal
  version takes the remembered specs, and any change, hostile ones included, gets the same
  answer as an engine that remembers nothing (a property test);
- copy programs of :class:`~aiosync.ModuleSink` (:mod:`aiosync.engine.bulk_apply`): the
  same bytes land, also after a target was given new storage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiosync import ModuleSink
from aiosync.core.bulk_copy import pack_tiny, scatter_bytes
from aiosync.core.errors import AiosyncError, MismatchError, ProtocolError
from aiosync.core.layout import BucketPlan, TensorSpec, pack_bucket, plan_buckets, view_spec
from aiosync.core.layout_memory import LayoutMemory
from aiosync.core.limits import Limits
from aiosync.core.manifest import build_manifest, expectations_of, unique_storage
from aiosync.core.planning import lay_out, read_source
from aiosync.core.stream_state import StreamMemory, StreamState, open_stream
from aiosync.core.wire import Begin, Bucket, Complete, Slot

CAPACITY = 4096


def mixed() -> dict[str, torch.Tensor]:
    """Tiny 1-D tensors of several dtypes among 2-D, 0-d, empty, strided and chunked ones."""
    z = torch.randn(3, dtype=torch.complex64)
    return {
        "a": torch.arange(3, dtype=torch.float32),
        "b": torch.ones(2, 2),
        "c": torch.tensor([True, False, True]),
        "d": torch.arange(5, dtype=torch.int64),
        "e": torch.tensor(7.0),
        "f": torch.zeros(0),
        "g": torch.arange(10, dtype=torch.float16)[::2],
        "h": z.conj(),
        "i": z.conj().imag,
        "big": torch.arange(3000, dtype=torch.float32),  # 12,000 bytes: chunked
        "j": torch.arange(200, dtype=torch.float32),  # 800 bytes: not tiny
        "k": torch.full((4,), 3, dtype=torch.bfloat16),
    }


def plans_of(layout: Any) -> list[BucketPlan]:
    return list(layout.buckets(CAPACITY))


# --------------------------------------------------------------------------------------
# one pass: manifest and plans
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_items", [1, 3, 4096])
def test_lay_out_matches_manifest_and_planner(max_items: int) -> None:
    tensors = mixed()
    layout = lay_out(tensors.items(), CAPACITY, max_items)
    assert layout is not None
    assert layout.manifest == build_manifest(tensors.items(), CAPACITY)
    ours = plans_of(layout)
    theirs = list(plan_buckets(tensors.items(), CAPACITY, max_items))
    assert [p.specs for p in ours] == [p.specs for p in theirs]
    assert [p.used for p in ours] == [p.used for p in theirs]
    index = {meta.name: i for i, meta in enumerate(layout.manifest)}
    for plan in ours:
        assert plan.entries == [index[spec.name] for spec in plan.specs]
        counted = (plan.whole_tensors, plan.payload_bytes)
        assert counted == (
            sum(spec.is_last_chunk for spec in plan.specs),
            sum(spec.nbytes for spec in plan.specs),
        )
        for dtype, positions in plan.tiny.items():
            for i in positions:
                spec = plan.specs[i]
                assert (spec.dtype, len(spec.shape), spec.is_whole) == (dtype, 1, True)
                assert spec.nbytes <= 512


def test_lay_out_drops_later_names_of_one_tensor_like_unique_storage() -> None:
    shared = torch.ones(4)
    pairs = {"x": shared, "y": torch.zeros(2), "tied": shared, "view": shared[:2]}
    layout = lay_out(pairs.items(), CAPACITY, dedupe=True)
    assert layout is not None
    kept = unique_storage(pairs.items())
    assert [m.name for m in layout.manifest] == [name for name, _ in kept] == ["x", "y", "view"]
    assert lay_out(pairs.items(), CAPACITY) is not None  # without dedupe, all four go
    assert len(lay_out(pairs.items(), CAPACITY).manifest) == 4  # type: ignore[union-attr]


def test_lay_out_refuses_like_the_planner() -> None:
    with pytest.raises(MismatchError, match="appears twice") as raised:
        lay_out([("a", torch.ones(1)), ("b", torch.ones(1)), ("a", torch.ones(2))], CAPACITY)
    assert raised.value.tensor == "a"
    bad = [("a", torch.ones(1)), ("a", torch.ones(1)), ("u", torch.zeros(2, dtype=torch.uint16))]
    with pytest.raises(MismatchError, match="appears twice"):  # the earlier problem first
        lay_out(bad, CAPACITY)
    with pytest.raises(MismatchError, match="cannot be streamed") as raised:
        lay_out([("u", torch.zeros(2, dtype=torch.uint16))], CAPACITY)
    assert raised.value.tensor == "u"


def test_lay_out_leaves_async_values_to_the_lazy_planner() -> None:
    class Pending:
        def wait(self) -> torch.Tensor:
            return torch.ones(3)

    pairs = {"a": torch.zeros(2), "b": Pending()}
    assert lay_out(pairs.items(), CAPACITY) is None
    read = read_source(pairs, None, CAPACITY)
    assert read.manifest is None
    assert [spec.name for plan in read.plans for spec in plan.specs] == ["a", "b"]


def test_read_source_of_a_module_and_of_a_generator() -> None:
    module = torch.nn.Linear(3, 2)
    read = read_source(module, None, CAPACITY)
    assert [m.name for m in read.manifest or ()] == ["weight", "bias"]
    gen = ((name, t) for name, t in mixed().items())
    lazy = read_source(gen, None, CAPACITY)
    assert lazy.manifest is None
    assert lazy.pairs is None
    assert sum(p.whole_tensors for p in lazy.plans) == len(mixed())


# --------------------------------------------------------------------------------------
# packing tiny tensors per dtype
# --------------------------------------------------------------------------------------


def packed_both_ways(plans: list[BucketPlan]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    fast, slow = [], []
    for plan in plans:
        one = torch.full((CAPACITY,), 0xAB, dtype=torch.uint8)
        pack_bucket(one, plan)
        other = torch.full((CAPACITY,), 0xAB, dtype=torch.uint8)
        pack_bucket(other, BucketPlan(plan.tensors, plan.specs, plan.used))  # no groups
        fast.append(one)
        slow.append(other)
    return fast, slow


def test_tiny_groups_pack_the_same_bytes_as_one_copy_per_tensor() -> None:
    tensors = mixed()
    layout = lay_out(tensors.items(), CAPACITY)
    assert layout is not None
    plans = plans_of(layout)
    assert any(len(p.tiny) > 1 for p in plans)  # several dtypes grouped in one bucket
    fast, slow = packed_both_ways(plans)
    for one, other in zip(fast, slow, strict=True):
        assert torch.equal(one, other)  # values and the untouched padding
    for plan, buffer in zip(plans, fast, strict=True):
        for spec in plan.specs:
            if spec.is_whole:
                expected = tensors[spec.name].resolve_conj().resolve_neg()
                assert torch.equal(view_spec(buffer, spec), expected), spec.name


def test_packing_parameters_leaves_the_buffer_without_autograd_history() -> None:
    params = {f"p{i}": torch.nn.Parameter(torch.randn(3)) for i in range(6)}
    (plan,) = plans_of(lay_out(params.items(), CAPACITY))
    buffer = torch.zeros(CAPACITY, dtype=torch.uint8)
    pack_bucket(buffer, plan)
    assert buffer.grad_fn is None
    assert not buffer.requires_grad
    assert torch.equal(view_spec(buffer, plan.specs[5]), params["p5"].detach())


def test_a_group_that_cannot_go_at_once_is_packed_one_by_one() -> None:
    tensors = {"a": torch.ones(2), "b": torch.full((2,), 2.0)}
    (plan,) = plans_of(lay_out(tensors.items(), CAPACITY))
    plan.tensors[1] = torch.full((1, 2), 2.0)  # no longer one-dimensional: cat refuses
    spare = torch.zeros(CAPACITY, dtype=torch.uint8)
    assert pack_tiny(spare, plan.tensors, plan.specs, plan.tiny) is None
    buffer = torch.zeros(CAPACITY, dtype=torch.uint8)
    pack_bucket(buffer, plan)
    assert torch.equal(view_spec(buffer, plan.specs[1]), torch.full((2,), 2.0))


def test_scatter_refuses_what_it_cannot_copy_and_writes_nothing() -> None:
    buffer = torch.zeros(2048, dtype=torch.uint8)
    assert not scatter_bytes(buffer, [torch.ones(2)], torch.float16, [0], [8])  # dtype
    assert not scatter_bytes(buffer, [torch.ones(2)], torch.float32, [0], [4])  # size
    assert not scatter_bytes(buffer, [torch.ones(2)], torch.float32, [2], [8])  # alignment
    assert not scatter_bytes(buffer[1:], [torch.ones(2)], torch.float32, [0], [8])
    assert not bool(buffer.any())


# --------------------------------------------------------------------------------------
# the engine replays its last whole stream
# --------------------------------------------------------------------------------------

SIZES = [CAPACITY, CAPACITY]
MODEL = {name: torch.zeros_like(t) for name, t in mixed().items()}
EXPECT = expectations_of(MODEL, MODEL)


def stream_messages(version: int) -> tuple[Begin, list[Bucket]]:
    layout = lay_out(mixed().items(), CAPACITY, 3)
    assert layout is not None
    buckets = []
    for seq, plan in enumerate(layout.buckets(CAPACITY), start=1):
        slots = [
            Slot(e, s.offset, s.nbytes, s.start)
            for e, s in zip(plan.entries, plan.specs, strict=True)
        ]
        buckets.append(Bucket(version, seq, seq % 2, plan.used, slots=slots))
    return Begin(version, layout.manifest), buckets


def run_stream(
    begin: Begin, buckets: list[Bucket], memory: StreamMemory | None, sizes: list[int] = SIZES
) -> tuple[StreamState, list[list[TensorSpec]]]:
    stream = open_stream(begin, EXPECT, Limits(), memory)
    resolved = []
    for bucket in buckets:
        resolved.append(stream.resolve(bucket, sizes))
        stream.buckets += 1
    return stream, resolved


def remembered() -> StreamMemory:
    begin, buckets = stream_messages(0)
    stream, _ = run_stream(begin, buckets, None)
    stream.check_whole(Complete(0, len(buckets) + 1, len(buckets), len(begin.manifest or ())))
    memory = stream.memory()
    assert memory is not None
    return memory


def test_an_equal_version_replays_the_remembered_specs() -> None:
    memory = remembered()
    begin, buckets = stream_messages(1)
    stream, resolved = run_stream(begin, buckets, memory)
    assert stream.manifest is memory.manifest
    assert all(a is b.specs for a, b in zip(resolved, memory.records, strict=True))
    stream.check_whole(Complete(1, len(buckets) + 1, len(buckets), len(memory.manifest)))
    assert stream.memory() is memory


def test_a_changed_manifest_is_checked_in_full() -> None:
    memory = remembered()
    begin, _ = stream_messages(1)
    assert begin.manifest is not None
    begin.manifest[0] = type(begin.manifest[0])("a", "float32", (4,))
    with pytest.raises(MismatchError, match="model has"):
        open_stream(begin, EXPECT, Limits(), memory)


def test_a_tensor_repeated_after_the_replay_ends_is_refused() -> None:
    memory = remembered()
    begin, buckets = stream_messages(1)
    first = buckets[0].slots[0]
    moved = Slot(first.entry, buckets[1].used, first.nbytes, first.start)  # tiny: 512 bytes
    changed = Bucket(1, 2, buckets[1].buffer, buckets[1].used + 512, [*buckets[1].slots, moved])
    stream = open_stream(begin, EXPECT, Limits(), memory)
    stream.resolve(buckets[0], SIZES)  # replayed
    with pytest.raises(ProtocolError, match="sent twice"):
        stream.resolve(changed, SIZES)


def test_a_stream_cut_short_is_not_whole() -> None:
    memory = remembered()
    begin, buckets = stream_messages(1)
    stream, _ = run_stream(begin, buckets[:-1], memory)
    with pytest.raises(ProtocolError):
        stream.check_whole(Complete(1, len(buckets), len(buckets) - 1, len(memory.manifest)))


def test_smaller_buffers_refuse_a_remembered_bucket() -> None:
    memory = remembered()
    begin, buckets = stream_messages(1)
    with pytest.raises(ProtocolError, match="bytes of a"):
        run_stream(begin, buckets, memory, sizes=[1024, 1024])


MUTATIONS = ["entry", "offset", "nbytes", "start", "used", "buffer", "drop", "repeat", "swap"]


def mutate(bucket: Bucket, how: str, at: int, by: int) -> Bucket:
    slots = list(bucket.slots)
    i = at % len(slots)
    s = slots[i]
    if how == "entry":
        slots[i] = Slot(s.entry + by, s.offset, s.nbytes, s.start)
    elif how == "offset":
        slots[i] = Slot(s.entry, s.offset + 512 * by, s.nbytes, s.start)
    elif how == "nbytes":
        slots[i] = Slot(s.entry, s.offset, s.nbytes + by, s.start)
    elif how == "start":
        slots[i] = Slot(s.entry, s.offset, s.nbytes, s.start + by)
    elif how == "drop":
        del slots[i]
    elif how == "repeat":
        slots.append(Slot(s.entry, slots[-1].offset + 512, s.nbytes, s.start))
    elif how == "swap":
        slots[i], slots[-1] = slots[-1], slots[i]
    used = bucket.used + (512 * by if how == "used" else 0)
    buffer = bucket.buffer + (by if how == "buffer" else 0)
    return Bucket(bucket.version, bucket.seq, buffer, used, slots=slots)


def outcome(memory: StreamMemory | None, buckets: list[Bucket], begin: Begin) -> list[Any]:
    """Each bucket's specs (or the refusal) and the completion's verdict."""
    got: list[Any] = []
    try:
        stream = open_stream(begin, EXPECT, Limits(), memory)
        for bucket in buckets:
            got.append(stream.resolve(bucket, SIZES))
            stream.buckets += 1
        count = len(begin.manifest or ())
        stream.check_whole(Complete(1, len(buckets) + 1, len(buckets), count))
        got.append("whole")
    except AiosyncError as exc:
        got.append((type(exc), exc.reason, exc.tensor))
    return got


@settings(max_examples=150, deadline=None)
@given(
    which=st.integers(0, 10),
    how=st.sampled_from(MUTATIONS),
    at=st.integers(0, 10),
    by=st.sampled_from([-2, -1, 1, 2, 512]),
    cut=st.booleans(),
)
def test_replay_answers_every_change_as_a_fresh_engine(
    which: int, how: str, at: int, by: int, cut: bool
) -> None:
    """Remembering the last stream never changes what is accepted, applied or refused."""
    memory = remembered()
    begin, buckets = stream_messages(1)
    k = which % len(buckets)
    buckets[k] = mutate(buckets[k], how, at, by)
    if cut:
        buckets = buckets[: k + 1]
    assert outcome(memory, buckets, begin) == outcome(None, buckets, begin)


# --------------------------------------------------------------------------------------
# copy programs in the sink
# --------------------------------------------------------------------------------------


def small(count: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((2,), value + i) for i in range(count)}


def bucket_of(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[TensorSpec]]:
    (plan,) = list(plan_buckets(tensors.items(), 1 << 16))
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    pack_bucket(buffer, plan)
    return buffer[: plan.used], plan.specs


def test_a_repeated_bucket_lands_the_same_bytes_also_after_new_storage() -> None:
    model = small(40)
    sink = ModuleSink(model)
    sink.expectations()
    kept: list[TensorSpec] | None = None
    for version in range(3):
        sent = small(40, value=10.0 * (version + 1))
        bucket, specs = bucket_of(sent)
        specs = kept or specs  # the session hands over the same list again
        if version == 2:
            model["t7"].data = torch.zeros(2)  # new storage under one target
        sink.apply_bucket(bucket, specs)
        sink.commit(version)
        kept = specs
        assert all(torch.equal(model[n], t) for n, t in sent.items()), version


def test_tied_names_and_casts_still_go_the_sink_s_way() -> None:
    weight = torch.zeros(2)
    model = {**small(30), "tied": weight, "alias": weight, "half": torch.zeros(2)}
    sink = ModuleSink(model, cast=True)
    sink.expectations()
    sent = {**small(30, 5.0), "tied": torch.ones(2), "half": torch.full((2,), 1.5).half()}
    bucket, specs = bucket_of(sent)
    for version in range(2):
        sink.apply_bucket(bucket, specs)
        sink.commit(version)
    assert torch.equal(model["alias"], torch.ones(2))
    assert torch.equal(model["half"], torch.full((2,), 1.5))
    assert all(torch.equal(model[n], sent[n]) for n in small(30))


# --------------------------------------------------------------------------------------
# the sender's last layout, reused
# --------------------------------------------------------------------------------------


def layout_equal(a: Any, b: Any) -> bool:
    plans_a, plans_b = plans_of(a), plans_of(b)
    return (
        a.manifest == b.manifest
        and [p.specs for p in plans_a] == [p.specs for p in plans_b]
        and [p.entries for p in plans_a] == [p.entries for p in plans_b]
        and [p.tiny for p in plans_a] == [p.tiny for p in plans_b]
        and all(
            all(x is y for x, y in zip(p.tensors, q.tensors, strict=True))
            for p, q in zip(plans_a, plans_b, strict=True)
        )
    )


CHANGES = {
    "values only": lambda t: {n: v + 1 for n, v in t.items()},  # new objects, same looks
    "a shape": lambda t: {**t, "a": torch.zeros(4)},
    "a dtype": lambda t: {**t, "d": t["d"].int()},
    "a name": lambda t: {("z" if n == "a" else n): v for n, v in t.items()},
    "one more": lambda t: {**t, "new": torch.ones(1)},
    "one less": lambda t: {n: v for n, v in t.items() if n != "b"},
    "a tie": lambda t: {**t, "c": t["a"]},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_kept_layout_is_what_a_fresh_pass_makes(change: str) -> None:
    memory = LayoutMemory()
    first = mixed()
    assert layout_equal(
        memory.lay_out(first.items(), CAPACITY, 3, dedupe=True),
        lay_out(first.items(), CAPACITY, 3, dedupe=True),
    )
    again = memory.lay_out(first.items(), CAPACITY, 3, dedupe=True)
    assert again is not None
    assert again.manifest is memory._kept.layout.manifest  # type: ignore[union-attr]
    changed = CHANGES[change](first)
    ours = memory.lay_out(changed.items(), CAPACITY, 3, dedupe=True)
    assert layout_equal(ours, lay_out(changed.items(), CAPACITY, 3, dedupe=True))


def test_a_kept_layout_is_not_used_for_other_buffers_or_async_values() -> None:
    memory = LayoutMemory()
    tensors = mixed()
    memory.lay_out(tensors.items(), CAPACITY, 3)
    bigger = memory.lay_out(tensors.items(), 2 * CAPACITY, 3)
    assert layout_equal(bigger, lay_out(tensors.items(), 2 * CAPACITY, 3))

    class Pending:
        def wait(self) -> torch.Tensor:
            return torch.ones(3)

    assert memory.lay_out({**tensors, "a": Pending()}.items(), 2 * CAPACITY, 3) is None


def test_the_step_timer_runs_both_sides_and_checks_the_result() -> None:
    from benchmarks.per_tensor_steps import measure

    steps = measure(300, 3)  # raises if the engine's tensors differ from the trainer's
    assert {step.split(":")[0] for step in steps} == {"trainer", "engine"}
    assert "engine: apply" in steps


def test_a_target_made_a_strided_view_in_place_gets_its_values_not_raw_bytes() -> None:
    """``p.data = p.data.t()`` keeps the address: a kept copy program must not write the
    bucket's bytes there as if the target were still contiguous."""
    model = {f"t{i}": torch.zeros(2, 2) for i in range(40)}
    sink = ModuleSink(model)
    sink.expectations()
    kept: list[TensorSpec] | None = None
    for version in range(3):
        sent = {n: torch.arange(4.0).view(2, 2) + 10 * version + i for i, n in enumerate(model)}
        bucket, specs = bucket_of(sent)
        specs = kept or specs
        if version == 2:
            model["t7"].data = model["t7"].data.t()  # same storage and address, strided
        sink.apply_bucket(bucket, specs)
        sink.commit(version)
        kept = specs
        assert all(torch.equal(model[n], t) for n, t in sent.items()), version
