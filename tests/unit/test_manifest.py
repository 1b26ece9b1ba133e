"""Tests of a version as a whole (:mod:`aiosync.core.manifest`) and of the buffer ledger.

Pure functions and classes: what a sender can read of its source without consuming it,
the manifest built from it, what an engine expects of a version (aliases included), and
which buffers engines still hold (:class:`aiosync.pipeline.ledger.BufferLedger`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn

from aiosync.core.errors import MismatchError
from aiosync.core.layout import ALIGNMENT, TensorSpec, plan_buckets
from aiosync.core.manifest import (
    Expectations,
    Expected,
    TensorMeta,
    build_manifest,
    chunk_count,
    describe,
    expectations_of,
    module_tensors,
    unique_storage,
    visible_pairs,
)
from aiosync.pipeline.ledger import BufferLedger

# --------------------------------------------------------------------------------------
# chunk counts and manifests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "capacity", "chunks"),
    [
        (0, 512, 1),
        (1, 512, 1),
        (511, 512, 1),
        (512, 512, 1),
        (513, 512, 2),
        (1024, 512, 2),
        (1025, 512, 3),
        (4096, 4096, 1),
        (4097, 4096, 2),
        (3 * 4096, 4096, 3),
        (3 * 4096 + 1, 4096, 4),
        (1536, 1536, 1),
        (1537, 1536, 2),
    ],
)
def test_chunk_count_at_capacity_boundaries(nbytes: int, capacity: int, chunks: int) -> None:
    assert chunk_count(nbytes, capacity) == chunks


BOUNDARY_BYTES = [0, 4, 508, 512, 516, 1020, 1024, 1028, 1536, 1540, 2048, 4096, 5000]


@pytest.mark.parametrize("capacity", [512, 1024, 1536])
def test_manifest_chunks_match_the_bucket_planner(capacity: int) -> None:
    """The manifest promises exactly as many pieces as the planner then sends."""
    tensors = {f"t{n}": torch.zeros(n // 4, dtype=torch.float32) for n in BOUNDARY_BYTES}
    tensors["odd"] = torch.zeros(capacity + 1, dtype=torch.uint8)
    manifest = build_manifest(tensors.items(), capacity)
    assert manifest is not None
    sent: dict[str, int] = {}
    for plan in plan_buckets(tensors.items(), capacity):
        for spec in plan.specs:
            sent[spec.name] = sent.get(spec.name, 0) + 1
    assert {meta.name: meta.chunks for meta in manifest} == sent


def test_manifest_entries_describe_each_tensor_in_order() -> None:
    pairs = [
        ("layers.0.w", torch.zeros(16, 32, dtype=torch.bfloat16)),
        ("scalar", torch.tensor(3.0)),
        ("empty", torch.zeros(0, 3, dtype=torch.int8)),
        ("big", torch.zeros(1000)),
    ]
    assert build_manifest(pairs, 1024) == [
        TensorMeta("layers.0.w", "bfloat16", (16, 32), 1),
        TensorMeta("scalar", "float32", (), 1),
        TensorMeta("empty", "int8", (0, 3), 1),
        TensorMeta("big", "float32", (1000,), 4),
    ]


def test_manifest_of_nothing_is_empty() -> None:
    assert build_manifest([], 1024) == []


def test_manifest_with_a_name_twice_raises_naming_it() -> None:
    pairs = [("a", torch.zeros(2)), ("b", torch.zeros(2)), ("a", torch.ones(2))]
    with pytest.raises(MismatchError, match="appears twice") as info:
        build_manifest(pairs, 1024)
    assert info.value.tensor == "a"


class _Pending:
    """What an async collective returns: a tensor once waited for."""

    def wait(self) -> torch.Tensor:
        raise AssertionError("a manifest must not wait for a result")


@pytest.mark.parametrize("value", [_Pending(), 3, None, [1.0, 2.0]])
def test_manifest_of_a_value_that_is_not_yet_a_tensor_is_none(value: Any) -> None:
    assert build_manifest([("a", torch.zeros(2)), ("b", value)], 1024) is None


@pytest.mark.parametrize("capacity", [0, 1, ALIGNMENT - 1])
def test_manifest_needs_a_capacity_of_one_alignment(capacity: int) -> None:
    with pytest.raises(ValueError, match=f"at least {ALIGNMENT}"):
        build_manifest([("a", torch.zeros(2))], capacity)


def test_manifest_with_a_dtype_that_cannot_stream_names_the_tensor() -> None:
    with pytest.raises(MismatchError, match="cannot be streamed") as info:
        build_manifest([("a", torch.zeros(2)), ("u16", torch.zeros(2, dtype=torch.uint16))], 1024)
    assert info.value.tensor == "u16"
    with pytest.raises(MismatchError):
        describe("u16", torch.zeros(2, dtype=torch.uint16), 1024)


def test_manifest_describes_a_strided_tensor_by_its_logical_shape() -> None:
    tensor = torch.zeros(8, 4).t()
    assert describe("t", tensor, 1024) == TensorMeta("t", "float32", (4, 8), 1)


# --------------------------------------------------------------------------------------
# what a sender can read without consuming it
# --------------------------------------------------------------------------------------

PAIRS = [("a", torch.zeros(2)), ("b", torch.ones(3))]


@pytest.mark.parametrize(
    "make",
    [
        lambda: dict(PAIRS),
        lambda: dict(PAIRS).items(),
        lambda: OrderedDict(PAIRS),
        lambda: MappingProxyType(dict(PAIRS)),
    ],
    ids=["dict", "items", "ordered", "proxy"],
)
def test_visible_pairs_of_a_mapping_or_its_items(make: Any) -> None:
    pairs = visible_pairs(make())
    assert pairs is not None
    assert list(pairs) == PAIRS
    assert list(pairs) == PAIRS  # read twice: once for the manifest, once to send
    assert len(pairs) == len(PAIRS)


@pytest.mark.parametrize("kind", [list, tuple])
def test_visible_pairs_of_a_list_or_tuple_is_the_source_itself(kind: type) -> None:
    source = kind(PAIRS)
    assert visible_pairs(source) is source  # read in place, never copied


def test_visible_pairs_of_a_generator_is_none_and_leaves_it_unread() -> None:
    started: list[bool] = []

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        started.append(True)
        yield from PAIRS

    source = gathered()
    assert visible_pairs(source) is None
    assert started == []  # not even the first item was asked for
    assert list(source) == PAIRS


@pytest.mark.parametrize(
    "make",
    [
        lambda: iter(PAIRS),
        lambda: map(tuple, PAIRS),
        lambda: zip(["a", "b"], [PAIRS[0][1], PAIRS[1][1]], strict=True),
        lambda: nn.Linear(2, 2).named_parameters(),
    ],
    ids=["iterator", "map", "zip", "named_parameters"],
)
def test_visible_pairs_of_any_other_iterator_is_none_and_leaves_it_unread(make: Any) -> None:
    source = make()
    before = sum(1 for _ in make())
    assert visible_pairs(source) is None
    assert sum(1 for _ in source) == before


def test_visible_pairs_of_a_module_is_read_through_its_tensors() -> None:
    module = nn.Linear(3, 2)
    assert visible_pairs(module) is None
    pairs = visible_pairs(module_tensors(module))
    assert pairs is not None
    assert [name for name, _ in pairs] == ["weight", "bias"]


# --------------------------------------------------------------------------------------
# module tensors
# --------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    """Embedding tied to the head, a persistent and a non-persistent buffer, a None buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("rope_cache", torch.zeros(8), persistent=False)
        self.register_buffer("unset", None)


def test_module_tensors_are_parameters_and_persistent_buffers() -> None:
    model = TiedLM()
    tensors = module_tensors(model)
    assert list(tensors) == [
        "embed.weight",
        "block.0.weight",
        "block.0.bias",
        "block.1.weight",
        "block.1.bias",
        "steps",
    ]
    assert tensors["embed.weight"] is model.embed.weight
    assert tensors["steps"] is model.steps


def test_module_tensors_list_a_tied_parameter_once_under_its_first_name() -> None:
    tensors = module_tensors(TiedLM())
    assert "head.weight" not in tensors
    assert sum(t is tensors["embed.weight"] for t in tensors.values()) == 1


def test_module_tensors_of_a_nested_persistent_buffer() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3))
    assert list(module_tensors(model)) == [
        "0.weight",
        "0.bias",
        "0.running_mean",
        "0.running_var",
        "0.num_batches_tracked",
    ]


# --------------------------------------------------------------------------------------
# expectations
# --------------------------------------------------------------------------------------


def sink_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a sink writes, tied names included (as ``ModuleSink`` lists them)."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def test_expectations_of_a_module_with_tied_weights() -> None:
    model = TiedLM()
    targets = sink_targets(model)
    expect = expectations_of(targets, module_tensors(model))
    assert expect.aliases == {"head.weight": "embed.weight"}
    assert set(expect.tensors) == set(targets)
    assert expect.tensors["head.weight"] == Expected("float32", (10, 4), True)
    assert expect.tensors["steps"] == Expected("int64", (), True)
    assert expect.required == frozenset(module_tensors(model))
    assert "rope_cache" in expect.tensors  # a sink may take it; a version need not carry it
    assert "rope_cache" not in expect.required


def test_alias_counts_as_covered_either_way() -> None:
    model = TiedLM()
    required = ["embed.weight", "head.weight", "block.0.weight"]
    expect = expectations_of(sink_targets(model), required)
    assert expect.canonical("head.weight") == "embed.weight"
    assert expect.canonical("block.0.weight") == "block.0.weight"
    assert expect.missing(["embed.weight", "block.0.weight"]) == []
    assert expect.missing(["head.weight", "block.0.weight"]) == []
    assert expect.missing(["block.0.weight"]) == ["embed.weight", "head.weight"]


def test_expectations_mark_targets_that_cannot_take_chunks() -> None:
    base = torch.zeros(4, 8)
    targets = {
        "plain": torch.zeros(8),
        "transposed": base.t(),
        "conj": torch.zeros(3, dtype=torch.complex64).conj(),
        "neg": torch.zeros(3, dtype=torch.complex64).conj().imag,
    }
    expect = expectations_of(targets, [])
    assert expect.tensors["plain"].chunkable
    assert not expect.tensors["transposed"].chunkable
    assert expect.tensors["transposed"].shape == (8, 4)
    assert not expect.tensors["conj"].chunkable
    assert not expect.tensors["neg"].chunkable
    expect.check_chunked("plain")
    with pytest.raises(MismatchError, match="contiguous target") as info:
        expect.check_chunked("transposed")
    assert info.value.tensor == "transposed"
    expect.check_chunked("unknown")  # not this check's business


def test_expectations_never_alias_meta_empty_or_disjoint_tensors() -> None:
    meta = torch.zeros(4, device="meta")
    storage = torch.zeros(16)
    targets = {
        "m1": meta,
        "m2": meta,
        "e1": torch.zeros(0),
        "e2": torch.zeros(0),
        "front": storage[:8],
        "back": storage[8:],
    }
    assert expectations_of(targets, targets).aliases == {}


def test_expectations_alias_the_same_tensor_under_two_names() -> None:
    shared = torch.zeros(3, 3)
    expect = expectations_of({"w": shared, "w2": shared, "view": shared.view(3, 3)}, [])
    assert expect.aliases == {"w2": "w", "view": "w"}


def test_expectations_do_not_alias_views_that_share_only_a_start() -> None:
    storage = torch.zeros(16)
    expect = expectations_of({"head": storage[:4], "every4th": storage[::4]}, ["every4th"])
    assert expect.aliases == {}
    assert expect.missing(["head"]) == ["every4th"]


MODEL = Expectations(
    {
        "a": Expected("float32", (4,)),
        "b": Expected("float32", (4,)),
        "c": Expected("bfloat16", (2, 2)),
        "strided": Expected("float32", (8, 4), chunkable=False),
    },
    frozenset({"a", "b", "c"}),
)


@pytest.mark.parametrize(
    ("meta", "text"),
    [
        (TensorMeta("ghost", "float32", (4,)), "no such parameter or buffer"),
        (TensorMeta("a", "float32", (5,)), "sent float32[5], model has float32[4]"),
        (TensorMeta("c", "float16", (2, 2)), "sent float16[2, 2], model has bfloat16[2, 2]"),
        (TensorMeta("a", "float32", (2, 2)), "sent float32[2, 2], model has float32[4]"),
        (TensorMeta("strided", "float32", (8, 4), chunks=2), "contiguous target"),
    ],
    ids=["unknown", "shape", "dtype", "reshaped", "chunked into strided"],
)
def test_check_manifest_names_the_tensor_at_fault(meta: TensorMeta, text: str) -> None:
    manifest = [
        TensorMeta("a", "float32", (4,)),
        TensorMeta("b", "float32", (4,)),
        TensorMeta("c", "bfloat16", (2, 2)),
    ]
    if meta.name in {m.name for m in manifest}:
        manifest = [meta if m.name == meta.name else m for m in manifest]
    else:
        manifest.append(meta)
    with pytest.raises(MismatchError) as info:
        MODEL.check_manifest(manifest)
    assert text in info.value.reason
    assert info.value.tensor == meta.name
    assert repr(meta.name) in str(info.value)


def test_check_manifest_names_the_missing_tensors() -> None:
    with pytest.raises(MismatchError) as info:
        MODEL.check_manifest([TensorMeta("b", "float32", (4,))])
    assert info.value.reason == "version misses 2 required tensors: a, c"
    assert info.value.tensor == "a"


def test_check_manifest_shows_the_first_five_missing_tensors() -> None:
    names = [f"layers.{i}" for i in range(8)]
    expect = Expectations({name: Expected("float32", (1,)) for name in names}, frozenset(names))
    with pytest.raises(MismatchError) as info:
        expect.check_manifest([])
    assert info.value.reason == (
        "version misses 8 required tensors: layers.0, layers.1, layers.2, layers.3, layers.4 ..."
    )


def test_check_manifest_accepts_a_fitting_version() -> None:
    MODEL.check_manifest(
        [
            TensorMeta("c", "bfloat16", (2, 2)),
            TensorMeta("a", "float32", (4,), chunks=3),
            TensorMeta("b", "float32", (4,)),
            TensorMeta("strided", "float32", (8, 4)),
        ]
    )


def test_check_takes_a_bucket_spec_too() -> None:
    MODEL.check(TensorSpec("a", "float32", (4,), 0, 16))
    with pytest.raises(MismatchError, match="float32\\[3\\]") as info:
        MODEL.check(TensorSpec("b", "float32", [3], 0, 12))  # type: ignore[arg-type]
    assert info.value.tensor == "b"


# --------------------------------------------------------------------------------------
# buffer ledger
# --------------------------------------------------------------------------------------


def test_ledger_frees_a_buffer_once_every_engine_released_it() -> None:
    ledger: BufferLedger[str] = BufferLedger()
    ledger.hold(0, ["e0", "e1", "e2"], "bucket-1")
    ledger.hold(1, ["e0"], "bucket-2")
    assert ledger.held == 2
    assert ledger.release(0, "e1") is None
    assert ledger.release(0, "e0") is None
    assert ledger.release(1, "e0") == "bucket-2"
    assert ledger.held == 1
    assert ledger.release(0, "e2") == "bucket-1"
    assert ledger.held == 0


def test_ledger_refuses_to_hold_a_held_buffer() -> None:
    ledger: BufferLedger[int] = BufferLedger()
    ledger.hold(3, ["e0"], 1)
    with pytest.raises(RuntimeError, match="buffer 3 is still held"):
        ledger.hold(3, ["e1"], 2)
    assert ledger.release(3, "e0") == 1
    ledger.hold(3, ["e1"], 2)  # free again


def test_ledger_release_by_an_engine_that_does_not_hold_it_changes_nothing() -> None:
    ledger: BufferLedger[int] = BufferLedger()
    ledger.hold(0, ["e0"], 7)
    assert ledger.release(0, "stranger") is None
    assert ledger.held == 1
    with pytest.raises(KeyError):
        ledger.release(5, "e0")


def test_ledger_drop_releases_every_hold_of_a_lost_engine() -> None:
    ledger: BufferLedger[str] = BufferLedger()
    ledger.hold(0, ["e0", "e1"], "b0")
    ledger.hold(1, ["e1"], "b1")
    ledger.hold(2, ["e0"], "b2")
    ledger.hold(3, ["e1", "e2"], "b3")
    assert ledger.drop("e1") == [(1, "b1")]
    assert ledger.held == 3
    assert ledger.drop("e1") == []
    assert ledger.drop("e0") == [(0, "b0"), (2, "b2")]
    assert ledger.release(3, "e2") == "b3"
    assert ledger.held == 0


def test_ledger_takes_its_engines_from_any_iterable() -> None:
    ledger: BufferLedger[str] = BufferLedger()
    ledger.hold(0, (name for name in ("e0", "e1")), "b0")
    assert ledger.release(0, "e0") is None
    assert ledger.release(0, "e1") == "b0"


# --------------------------------------------------------------------------------------
# tied tensors sent once, casting and renames in expectations
# --------------------------------------------------------------------------------------


def test_unique_storage_keeps_the_first_name_of_each_tensor() -> None:
    model = TiedLM()
    state = model.state_dict()
    assert "head.weight" in state
    kept = [name for name, _ in unique_storage(state.items())]
    assert kept == [name for name in state if name != "head.weight"]
    storage = torch.zeros(4, 4)
    pairs = [
        ("a", storage),
        ("same", storage.view(4, 4)),
        ("t", storage.t()),  # other stride: another tensor
        ("half", storage[:2]),  # other shape
        ("bytes", storage.view(torch.int32)),  # other dtype
        ("m1", torch.zeros(2, device="meta")),
        ("e1", torch.zeros(0)),
        ("e2", torch.zeros(0)),
        ("later", 3),  # not yet a tensor: kept
    ]
    assert [n for n, _ in unique_storage(pairs)] == [
        "a",
        "t",
        "half",
        "bytes",
        "m1",
        "e1",
        "e2",
        "later",
    ]


def test_castable_expectations_take_any_float_dtype_of_the_right_shape() -> None:
    targets = {"w": torch.zeros(2, 3), "steps": torch.zeros((), dtype=torch.int64)}
    plain = expectations_of(targets, targets)
    cast = expectations_of(targets, targets, cast=True)
    assert not plain.tensors["w"].castable
    assert cast.tensors["w"].castable
    assert not cast.tensors["steps"].castable  # integers are never cast
    bf16 = TensorMeta("w", "bfloat16", (2, 3))
    with pytest.raises(MismatchError, match=r"sent bfloat16\[2, 3\], model has float32"):
        plain.check(bf16)
    cast.check(bf16)
    cast.check(TensorMeta("w", "float16", (2, 3)))
    with pytest.raises(MismatchError, match="model has float32"):
        cast.check(TensorMeta("w", "bfloat16", (3, 2)))
    with pytest.raises(MismatchError, match="sent int32"):
        cast.check(TensorMeta("w", "int32", (2, 3)))
    with pytest.raises(MismatchError, match="sent float32"):
        cast.check(TensorMeta("steps", "float32", ()))


def test_renamed_expectations_look_up_engine_names_and_report_sent_ones() -> None:
    model = TiedLM()
    expect = expectations_of(
        sink_targets(model), module_tensors(model), rename=lambda n: n.removeprefix("model.")
    )
    expect.check(TensorMeta("model.block.0.weight", "float32", (4, 4)))
    with pytest.raises(MismatchError, match="no such parameter") as info:
        expect.check(TensorMeta("model.nothing", "float32", (4, 4)))
    assert info.value.tensor == "model.nothing"
    assert expect.canonical("model.head.weight") == "embed.weight"
    sent = ["model." + name for name in module_tensors(model) if name != "embed.weight"]
    assert expect.missing([*sent, "model.head.weight"]) == []
    assert expect.missing(sent) == ["embed.weight"]  # missing names are the engine's


class SharedBlock(nn.Module):
    """One submodule reached under two names, and a buffer tied across two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        self.b = self.a  # the same submodule twice
        self.c = nn.Linear(3, 3)
        self.c.register_buffer("table", self.a[1].running_mean)  # one buffer, two names
        self.register_buffer("cache", torch.zeros(2), persistent=False)


@pytest.mark.parametrize(
    "make",
    [TiedLM, SharedBlock, lambda: nn.Transformer(16, 2, 1, 1, 32), lambda: nn.LSTM(4, 4, 2)],
)
def test_module_tensors_are_what_torch_lists_and_state_dict_keeps(make: Any) -> None:
    """One walk of the tree, as ``named_parameters``, ``named_buffers`` and ``state_dict``
    (which persistent buffers) would list the module."""
    model = make()
    persistent = set(model.state_dict(keep_vars=True))
    expected = dict(model.named_parameters())
    expected.update((n, b) for n, b in model.named_buffers() if n in persistent)
    got = module_tensors(model)
    assert list(got) == list(expected)
    assert all(got[name] is tensor for name, tensor in expected.items())


class Wrapped(nn.Module):
    """Lists its tensors without its wrapper's prefix, as FSDP's full-parameter view does."""

    def __init__(self) -> None:
        super().__init__()
        self._wrapped = TiedLM()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        for name, tensor in super().named_parameters(*args, **kwargs):
            yield name.removeprefix("_wrapped."), tensor

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        for name, tensor in super().named_buffers(*args, **kwargs):
            yield name.removeprefix("_wrapped."), tensor


def test_module_tensors_of_a_module_that_lists_its_tensors_its_own_way() -> None:
    model = Wrapped()
    tensors = module_tensors(model)
    assert list(tensors) == list(module_tensors(model._wrapped))  # the names it gives
    assert tensors["steps"] is model._wrapped.steps
    assert "rope_cache" not in tensors  # registered persistent=False


def test_module_tensors_persistence_is_how_a_buffer_was_registered() -> None:
    """``state_dict`` (and its hooks) is not consulted: under FSDP it is a collective."""
    model = TiedLM()

    def drop_steps(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
        del state[prefix + "steps"]

    model._register_state_dict_hook(drop_steps)
    assert "steps" not in model.state_dict()
    assert "steps" in module_tensors(model)
