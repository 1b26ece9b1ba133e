"""Colocated topology without processes: the pure layout, the part codec, the engine side.

The engine side is driven in this process with a trainer plane made here (a sealed memfd),
so every hostile-input case is checked without Gloo; tests/processes/test_topology_gloo.py runs the
whole path across four processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiosync.core.colocated_parts import FORMAT, RankPart, check_parts, decode_part, encode_part
from aiosync.core.errors import AiosyncError, ProtocolError, UsageError
from aiosync.core.layout import TensorSpec, plan_buckets
from aiosync.core.wire import ShmHandle
from aiosync.engine.sinks import ModuleSink
from aiosync.planes.shm import ShmSenderPlane
from aiosync.topology import ColocatedReceiver, connect_topology, plan_layout
from aiosync.topology.layout import derive_engine_gpu_offsets

# ----------------------------------------------------------------------------- layout


def test_dense_offsets_are_the_cumulative_sums() -> None:
    assert derive_engine_gpu_offsets([2, 2]) == [0, 2]
    assert derive_engine_gpu_offsets([1, 3]) == [0, 1]
    assert derive_engine_gpu_offsets([4]) == [0]
    assert derive_engine_gpu_offsets([]) == []


@pytest.mark.parametrize("bad", [[0], [2, -1], [1.5], [True]])
def test_offsets_refuse_counts_that_are_not_positive_integers(bad: list[Any]) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        derive_engine_gpu_offsets(bad)


@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.integers(0, 4))
def test_a_dense_layout_covers_ranks_once_in_order(counts: list[int], spare: int) -> None:
    world = sum(counts) + spare
    layout = plan_layout(counts, None, world)
    owners = [layout.engine_of(rank) for rank in range(world)]
    covered = [e.index for e in owners if e is not None]
    assert covered == [i for i, c in enumerate(counts) for _ in range(c)]  # dense, in order
    assert layout.placeholders == list(range(sum(counts), world))
    for engine in layout.engines:
        assert engine.source == engine.ranks[0] == derive_engine_gpu_offsets(counts)[engine.index]
        assert all(layout.engine_of(r) == engine for r in engine.ranks)


@given(st.data())
def test_any_accepted_layout_has_disjoint_ranges_inside_the_world(data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 10))
    n = data.draw(st.integers(1, 4))
    counts = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    offsets = data.draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    try:
        layout = plan_layout(counts, offsets, world)
    except ValueError:
        spans = [set(range(o, o + c)) for o, c in zip(offsets, counts, strict=True)]
        overlap = any(a & b for i, a in enumerate(spans) for b in spans[i + 1 :])
        assert overlap or any(o + c > world for o, c in zip(offsets, counts, strict=True))
        return
    seen: set[int] = set()
    for engine in layout.engines:
        assert set(engine.ranks).isdisjoint(seen)
        seen |= set(engine.ranks)
        assert max(engine.ranks) < world
    assert sorted(seen) == layout.covered_ranks
    assert sorted(seen | set(layout.placeholders)) == list(range(world))


def test_layout_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="empty"):
        plan_layout([], None, 4)
    with pytest.raises(ValueError, match="2 entries but engine_gpu_counts has 1"):
        plan_layout([2], [0, 2], 4)
    with pytest.raises(ValueError, match="both cover rank 1"):
        plan_layout([2, 2], [0, 1], 4)
    with pytest.raises(ValueError, match="world has 4 ranks"):
        plan_layout([2, 2], [0, 3], 4)
    with pytest.raises(ValueError, match="non-negative"):
        plan_layout([1], [-1], 4)


def test_layout_key_changes_with_the_layout_only() -> None:
    assert plan_layout([2, 2], None, 4).key == plan_layout([2, 2], [0, 2], 4).key
    assert plan_layout([2, 2], None, 4).key != plan_layout([1, 3], None, 4).key
    assert plan_layout([1, 2], [0, 2], 4).key != plan_layout([1, 2], None, 4).key


def test_connect_refuses_empty_and_mismatched_layouts_before_any_group() -> None:
    state: dict[str, Any] = {}
    with pytest.raises(ValueError, match="empty"):
        connect_topology(engine_gpu_counts=[], worker_state=state)
    with pytest.raises(ValueError, match="entries"):
        connect_topology(engine_gpu_counts=[2, 2], engine_gpu_offsets=[0], worker_state=state)
    assert state == {}


def test_connect_needs_torch_distributed() -> None:
    with pytest.raises(UsageError, match=r"torch\.distributed"):
        connect_topology(engine_gpu_counts=[1], worker_state={})


# ----------------------------------------------------------------------------- parts


def _part(**changes: Any) -> RankPart:
    base = RankPart(
        rank=1,
        engine=0,
        seq=0,
        buffer=ShmHandle(name="x", size=4096),
        used=1024,
        specs=[TensorSpec("a", "float32", (4,), 0, 16), TensorSpec("b", "int64", (2,), 512, 16)],
    )
    return msgspec.structs.replace(base, **changes)


def test_a_part_round_trips_as_msgpack() -> None:
    part = _part()
    data = encode_part(part)
    assert isinstance(data, bytes)
    assert decode_part(data) == part


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"used": 8192}, "bucket claims 8192"),
        ({"rank": -1}, "negative"),
        ({"specs": [TensorSpec("a", "float32", (4,), 100, 16)]}, "misaligned"),
        ({"specs": [TensorSpec("a", "float32", (4,), 0, 64)]}, "outside"),
        ({"specs": [TensorSpec("a", "nope", (4,), 0, 16)]}, "unknown dtype"),
        ({"last": True}, "carries tensors"),
    ],
)
def test_a_hostile_part_is_refused(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_part(encode_part(_part(**changes)))


@pytest.mark.parametrize("data", [b"", b"\x93\x01", b"\xc1" * 10, b"{}" * 3])
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_part(data)


def test_an_oversized_description_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="over"):
        decode_part(b"\x00" * 100, max_bytes=10)


@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_anything_but_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_part(data)


def test_parts_must_be_one_bucket_from_the_engines_ranks_in_order() -> None:
    parts = [_part(rank=2), _part(rank=3)]
    assert check_parts(parts, engine=0, ranks=[2, 3], seq=0) is False
    with pytest.raises(ProtocolError, match="expected bucket 0 of rank 2"):
        check_parts(parts[::-1], engine=0, ranks=[2, 3], seq=0)
    with pytest.raises(ProtocolError, match="2 parts for 3 ranks"):
        check_parts(parts, engine=0, ranks=[2, 3, 4], seq=0)
    ended = [RankPart(2, 0, 1, last=True), RankPart(3, 0, 1)]
    with pytest.raises(ProtocolError, match=r"ranks \[2\] ended"):
        check_parts(ended, engine=0, ranks=[2, 3], seq=1)


# ----------------------------------------------------------------------------- engine side


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 16, generator=gen),
        "h": torch.randn(5, generator=gen).to(torch.bfloat16),
        "i": torch.randint(0, 100, (7,), generator=gen),
    }


class Trainer:
    """What two colocated trainer ranks would hand an engine, made in this process."""

    def __init__(self, ranks: int = 2) -> None:
        self.planes = [ShmSenderPlane(1, 1 << 16) for _ in range(ranks)]

    def parts(self, seq: int, pairs: list[tuple[str, torch.Tensor]]) -> list[bytes]:
        out = []
        for rank, plane in enumerate(self.planes):
            (plan,) = plan_buckets(pairs, plane.capacity)
            plane.pack(0, plan)
            part = RankPart(rank, 0, seq, buffer=plane.spec.buffers[0], used=plan.used)
            out.append(encode_part(msgspec.structs.replace(part, specs=plan.specs)))
        return out

    def last(self, seq: int, commit: bool = False) -> list[bytes]:
        ranks = range(len(self.planes))
        return [encode_part(RankPart(r, 0, seq, last=True, commit=commit)) for r in ranks]

    def close(self) -> None:
        for plane in self.planes:
            plane.close()


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    made = Trainer()
    try:
        yield made
    finally:
        made.close()


def _engine(staged: bool = False) -> tuple[ColocatedReceiver, list[dict[str, torch.Tensor]]]:
    targets = [{k: torch.zeros_like(v) for k, v in _weights(0).items()} for _ in range(2)]
    sinks = [ModuleSink(t, staged=staged) for t in targets]
    return ColocatedReceiver(sinks, name="sglang-0"), targets


def _sync(engine: ColocatedReceiver, trainer: Trainer, seed: int, version: str | None) -> None:
    pairs = list(_weights(seed).items())
    for seq, bucket in enumerate([pairs[:2], pairs[2:]]):
        result = engine.update_weights_from_tensor(
            trainer.parts(seq, bucket), load_format=FORMAT, weight_version=version
        )
        assert result.success, result.message
    for seq, commit in ((2, False), (3, True)):  # prepare, then commit
        result = engine.update_weights_from_tensor(
            trainer.last(seq, commit), load_format=FORMAT, weight_version=version
        )
        assert result.success, result.message


def test_engine_applies_each_gpus_part_and_numbers_versions(trainer: Trainer) -> None:
    engine, targets = _engine()
    _sync(engine, trainer, 1, None)
    assert engine.current_version == 0
    _sync(engine, trainer, 2, None)
    assert engine.current_version == 1  # None: the engine's next version
    _sync(engine, trainer, 3, "9")
    assert engine.current_version == 9  # as given
    for target in targets:
        for name, tensor in _weights(3).items():
            assert torch.equal(target[name], tensor)
    engine.close()


def _refused(engine: ColocatedReceiver, entries: list[Any], match: str, **kwargs: Any) -> None:
    kwargs.setdefault("load_format", FORMAT)
    result = engine.update_weights_from_tensor(entries, **kwargs)
    assert not result.success
    assert match in result.message, result.message
    assert "sglang-0" in result.message


def test_engine_refuses_hostile_calls_and_keeps_its_staged_weights(trainer: Trainer) -> None:
    engine, targets = _engine(staged=True)
    _sync(engine, trainer, 1, "1")
    good = trainer.parts(0, list(_weights(2).items())[:2])
    _refused(engine, good, "load_format", load_format="flattened_bucket")
    _refused(engine, good[:1], "1 parts for an engine of 2 GPUs")
    _refused(engine, [b"\x00garbage", good[1]], "undecodable")
    _refused(engine, ["text", good[1]], "must be bytes")
    _refused(engine, good, "not an integer", weight_version="v2")
    _refused(engine, [good[0], trainer.last(0)[1]], "others do not")
    _refused(engine, good[::-1], "expected rank 2 for engine 0")
    unknown = trainer.parts(0, [("nope", torch.zeros(3))])
    _refused(engine, unknown, "no such parameter")
    wrong = trainer.parts(0, [("w", torch.zeros(3, 3))])
    _refused(engine, wrong, "model has float32[8, 16]")
    engine.update_weights_from_tensor(good, load_format=FORMAT)
    _refused(engine, trainer.last(1), "misses 1 tensors: i")
    errored = [encode_part(RankPart(r, 0, 0, error="CUDA OOM on purpose")) for r in (0, 1)]
    _refused(engine, errored, "trainer rank 0: CUDA OOM on purpose")
    assert engine.current_version == 1
    for target in targets:  # staged: no refused call changed a live weight
        for name, tensor in _weights(1).items():
            assert torch.equal(target[name], tensor)
    assert len(engine.failures) == 11
    _sync(engine, trainer, 4, "4")  # and it takes the next good version
    assert engine.current_version == 4
    engine.close()


def test_engine_drops_an_unfinished_sync_when_a_new_one_begins(trainer: Trainer) -> None:
    engine, targets = _engine(staged=True)
    pairs = list(_weights(5).items())
    assert engine.update_weights_from_tensor(
        trainer.parts(0, pairs[:2]), load_format=FORMAT
    ).success
    _sync(engine, trainer, 6, "6")  # begins at bucket 0 again: the half-sent one is dropped
    assert engine.current_version == 6
    assert all(torch.equal(t["w"], _weights(6)["w"]) for t in targets)
    engine.close()


def test_engine_refuses_a_buffer_it_cannot_open(trainer: Trainer) -> None:
    engine, _ = _engine()
    entries = trainer.parts(0, list(_weights(1).items())[:1])
    part = decode_part(entries[0])
    forged = msgspec.structs.replace(part, buffer=ShmHandle(name="aiosync-1-1-deadbeef", size=4096))
    _refused(engine, [encode_part(forged), entries[1]], "refusing shared-memory name")
    engine.close()


# ----------------------------------------------------------------------------- NeMo-RL names


def test_nemo_rl_names_raise_the_reference_builtin_types() -> None:
    from aiosync.compat import nemo_rl

    assert nemo_rl._derive_engine_gpu_offsets([2, 2]) == [0, 2]
    with pytest.raises(ValueError, match="positive integer") as bad:
        nemo_rl._derive_engine_gpu_offsets([0])
    assert isinstance(bad.value, AiosyncError)
    with pytest.raises(ValueError, match="empty") as empty:
        nemo_rl.connect_colocate_topology(engine_gpu_counts=[], worker_state={})
    assert isinstance(empty.value, AiosyncError)
    with pytest.raises(ValueError, match="entries"):
        nemo_rl.connect_colocate_topology(
            engine_gpu_counts=[1], engine_gpu_offsets=[0, 1], worker_state={}
        )
    with pytest.raises(RuntimeError, match=r"torch\.distributed"):
        nemo_rl.connect_colocate_topology(engine_gpu_counts=[1], worker_state={})
    with pytest.raises(RuntimeError, match="connect_colocate_topology first"):
        nemo_rl.send_hf_buckets_via_ipc_actor_impl(
            bucket_iterator=iter([]), rollout_engines=[], worker_state={}
        )


def test_a_placeholder_rank_returns_without_touching_anything() -> None:
    from aiosync.compat import nemo_rl

    def never() -> Iterator[list[tuple[str, torch.Tensor]]]:
        raise AssertionError("a placeholder rank must not read its buckets")
        yield []

    state = {"_ipc_layout": plan_layout([1], [1], 2), "_ipc_engine_index": None}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("torch.distributed.get_rank", lambda group=None: 0)
        nemo_rl.send_hf_buckets_via_ipc_actor_impl(
            bucket_iterator=never(), rollout_engines=[object()], worker_state=state
        )


def test_engine_commits_only_a_prepared_version_and_says_when_it_is_servable(
    trainer: Trainer,
) -> None:
    engine, _ = _engine()  # in place
    _sync(engine, trainer, 1, "1")
    assert engine.servable
    pairs = list(_weights(2).items())
    assert engine.update_weights_from_tensor(
        trainer.parts(0, pairs[:2]), load_format=FORMAT
    ).success
    assert not engine.servable  # in place: half of version 2 is in the weights
    _refused(engine, trainer.last(1, commit=True), "but None is prepared")
    assert engine.current_version == 1
    assert not engine.servable
    _sync(engine, trainer, 3, "3")
    assert engine.servable
    assert engine.update_weights_from_tensor(
        trainer.parts(0, pairs[:2]), load_format=FORMAT
    ).success
    assert engine.update_weights_from_tensor(
        trainer.parts(1, pairs[2:]), load_format=FORMAT
    ).success
    assert engine.update_weights_from_tensor(trainer.last(2), load_format=FORMAT).success
    _refused(engine, trainer.parts(3, pairs[:1]), "was prepared")
    engine.close()


def test_a_commit_part_in_the_middle_of_a_sync_is_refused() -> None:
    with pytest.raises(ProtocolError, match="commit in the middle"):
        decode_part(encode_part(RankPart(0, 0, 0, commit=True)))
