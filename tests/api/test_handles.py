"""Engine handles: answers as plain data, metadata checks, adapters, the control channel,
and the whole broadcast path with an in-process AiosyncEngine (Gloo, one process)."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import pytest
import torch

from aiosync import ModuleSink, PeerGoneError
from aiosync.channels.inproc import inproc_pair
from aiosync.compat import distributed
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    check_weight_sync_results,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.core.errors import ProtocolError, UsageError
from aiosync.core.layout import ALIGNMENT, TensorSpec
from aiosync.handles import (
    ChannelHandle,
    EngineHandle,
    NotAnEngineError,
    ObjectHandle,
    WeightSyncResult,
    as_engine_handle,
)
from aiosync.handles.channel import serve_peer
from aiosync.handles.engine import AiosyncEngine
from aiosync.handles.fleet import engine_rank_offsets
from aiosync.handles.metadata import bucket_layout
from aiosync.handles.results import as_result, failures
from tests.helpers.models import mixed_weights

# --- answers --------------------------------------------------------------------------


@dataclass
class Answer:
    success: bool
    error_message: str = ""


@pytest.mark.parametrize(
    ("reply", "success", "text"),
    [
        (None, True, ""),
        (True, True, ""),
        ((True, "ok"), True, "ok"),
        ((False, "bad dtype"), False, "bad dtype"),
        ([False, "as a list"], False, "as a list"),
        ({"success": False, "message": "m"}, False, "m"),
        ({"success": False, "error_message": "em"}, False, "em"),
        ({"success": False, "error": "e"}, False, "e"),
        ({"success": True}, True, ""),
        (Answer(False, "from an object"), False, "from an object"),
        (False, False, "the engine returned False"),
    ],
)
def test_answers_of_every_shape_read_as_results(reply: object, success: bool, text: str) -> None:
    result = as_result(reply)
    assert result.success is success
    assert result.message == text


def test_check_weight_sync_results_raises_runtime_error_with_each_engines_text() -> None:
    check_weight_sync_results([None, (True, ""), {"success": True}, [(True, ""), (True, "")]])
    with pytest.raises(RuntimeError, match="engine 1: out of memory") as info:
        check_weight_sync_results(
            [(True, ""), (False, "out of memory"), {"success": False, "error": "nan"}]
        )
    assert "engine 2: nan" in str(info.value)
    with pytest.raises(RuntimeError, match="engine 0: rank 1 failed"):
        check_weight_sync_results([[(True, ""), (False, "rank 1 failed")]])
    long = "x" * 100_000
    assert len(failures([(False, long)])[0]) < 5000  # a flood from an engine is cut


# --- metadata -------------------------------------------------------------------------


def test_layout_aligns_and_accepts_torch_dtype_names() -> None:
    specs, used = bucket_layout(
        ["a", "b", "c"], ["torch.bfloat16", "float32", "bool"], [[3, 5], [], [0]], max_bytes=10**6
    )
    assert [s.offset % ALIGNMENT for s in specs] == [0, 0, 0]
    assert specs[0] == TensorSpec("a", "bfloat16", (3, 5), 0, 30)
    assert specs[1].nbytes == 4
    assert specs[2].nbytes == 0
    assert used == 2 * ALIGNMENT


@pytest.mark.parametrize(
    ("names", "dtypes", "shapes", "match"),
    [
        (["a"], ["float32", "float32"], [[1]], "differ in length"),
        (["a", "a"], ["float32"] * 2, [[1], [1]], "twice"),
        (["a"], ["complex1024"], [[1]], "unknown dtype"),
        (["a"], ["float32"], [[-1]], "bad shape"),
        (["a"], ["float32"], [[True]], "bad shape"),
        (["a"], ["float32"], [[1 << 40]], "bytes an engine accepts"),
        ([""], ["float32"], [[1]], "bad tensor name"),
    ],
)
def test_layout_refuses_hostile_metadata(
    names: list[Any], dtypes: list[Any], shapes: list[Any], match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        bucket_layout(names, dtypes, shapes, max_bytes=1 << 30)


def test_rank_offsets_follow_gpu_counts_from_one() -> None:
    assert engine_rank_offsets([1, 2, 4]) == [1, 2, 4]
    assert engine_rank_offsets([2, 2]) == [1, 3]
    for bad in ([0], [-1], [1.5], [True]):
        with pytest.raises(UsageError):
            engine_rank_offsets(bad)  # type: ignore[arg-type]


# --- adapters -------------------------------------------------------------------------


class FakeEngine:
    """SGLang-shaped methods: sync ones, an async one, one without weight_version."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def init_weights_update_group(self, **kwargs: Any) -> tuple[bool, str]:
        self.calls.append(("init", kwargs))
        return True, "joined"

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:  # fmt: skip
        self.calls.append(("update", {"names": names, "shapes": shapes}))
        if "bad" in names:
            raise ValueError("no such parameter: bad")
        return True, ""

    async def update_weights_from_tensor(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(("tensor", kwargs))
        return {"success": False, "error_message": "not colocated"}

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.calls.append(("destroy", {"group_name": group_name}))

    def check_health(self) -> dict[str, Any]:
        return {"healthy": True, "weight_version": 7}


def test_what_can_be_a_rollout_engine() -> None:
    engine = FakeEngine()
    handle = as_engine_handle(engine, name="fake")
    assert isinstance(handle, ObjectHandle)
    assert handle.name == "fake"
    assert as_engine_handle(handle) is handle
    with pytest.raises(TypeError, match="not a rollout engine") as info:
        as_engine_handle(object())
    assert isinstance(info.value, NotAnEngineError)


async def test_object_handle_calls_sync_and_async_methods_with_plain_data() -> None:
    engine = FakeEngine()
    handle = ObjectHandle(engine, name="fake")
    assert (await handle.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "gloo")).success
    assert "token" not in engine.calls[-1][1]  # unset optional arguments are left out
    ok = await handle.update_weights_from_distributed(["w"], ["float32"], [(2, 3)], "g")
    assert ok.success
    assert engine.calls[-1][1]["shapes"] == [[2, 3]]
    refused = await handle.update_weights_from_distributed(["bad"], ["float32"], [[1]], "g")
    assert not refused.success
    assert "no such parameter: bad" in refused.message
    tensor = await handle.update_weights_from_tensor([b"\x00\x01"], load_format="flat")
    assert tensor == WeightSyncResult(False, "not colocated")
    assert (await handle.destroy_weights_update_group("g")).success
    health = await handle.check_health()
    assert health.healthy
    assert health.weight_version == "7"


async def test_channel_handle_round_trips_every_call_and_names_a_lost_engine() -> None:
    engine = FakeEngine()
    trainer_end, engine_end = inproc_pair("trainer", "engine")
    handle = ChannelHandle(trainer_end, name="remote")
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_peer, engine_end, ObjectHandle(engine))
        with anyio.fail_after(30):
            joined = await handle.init_weights_update_group(
                "127.0.0.1", 5, 1, 3, "g", "gloo", token="ab" * 16
            )
            assert joined == WeightSyncResult(True, "joined")
            assert engine.calls[-1][1]["token"] == "ab" * 16
            refused = await handle.update_weights_from_distributed(["bad"], ["float32"], [[1]])
            assert not refused.success
            assert "bad" in refused.message
            result = await handle.update_weights_from_tensor(["text entry"])
            assert engine.calls[-1][1]["serialized_named_tensors"] == ["text entry"]
            assert not result.success
            health = await handle.check_health()
            assert health.weight_version == "7"
        tg.cancel_scope.cancel()
    await engine_end.aclose()
    with anyio.fail_after(30), pytest.raises(PeerGoneError) as info:
        await handle.destroy_weights_update_group("g")
    assert info.value.peer == "remote"
    assert not (await handle.check_health()).healthy


async def test_engine_side_drops_malformed_requests_and_keeps_serving() -> None:
    engine = FakeEngine()
    trainer_end, engine_end = inproc_pair("trainer", "engine")
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_peer, engine_end, ObjectHandle(engine))
        with anyio.fail_after(30):
            for junk in (b"\xff\x00", msgspec.msgpack.encode({"id": 1, "call": {"type": "x"}})):
                await trainer_end.send(junk)
            handle = ChannelHandle(trainer_end, name="remote")
            assert (await handle.destroy_weights_update_group("g")).success
        tg.cancel_scope.cancel()
    assert [name for name, _ in engine.calls] == ["destroy"]


async def test_a_malformed_reply_is_a_protocol_error_naming_the_engine() -> None:
    trainer_end, engine_end = inproc_pair("trainer", "engine")
    handle = ChannelHandle(trainer_end, name="remote")
    await engine_end.send(b"\x01 not a reply")
    with anyio.fail_after(30), pytest.raises(ProtocolError, match="malformed reply") as info:
        await handle.destroy_weights_update_group("g")
    assert info.value.peer == "remote"


def test_compat_functions_are_keyword_only_like_the_reference() -> None:
    for function in (
        connect_rollout_engines_from_distributed,
        disconnect_rollout_engines_from_distributed,
        broadcast_hf_buckets_via_distributed_impl,
    ):
        kinds = {p.kind for p in inspect.signature(function).parameters.values()}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, function.__name__


# --- the whole path in one process ------------------------------------------------------


class LockCheckingSink(ModuleSink):
    """A staged module sink that records whether the rollout-engine lock was held."""

    def __init__(self, model: dict[str, torch.Tensor], lock: threading.Lock) -> None:
        super().__init__(model, staged=True)
        self.lock = lock
        self.held: list[bool] = []

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.held.append(self.lock.locked())
        super().apply_bucket(bucket, specs)


def test_in_process_engine_object_bit_exact_lock_held_and_previous_version_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "30")
    lock = threading.Lock()
    model = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in mixed_weights().items()}
    sink = LockCheckingSink(model, lock)
    engine = AiosyncEngine(sink, name="local", timeout=30)
    engines: list[object] = [engine]  # a raw engine object, as NeMo-RL might pass one
    group = connect_rollout_engines_from_distributed(
        group_name="inproc", rollout_engines=engines, engine_gpu_counts=[1]
    )
    try:
        weights = mixed_weights(seed=5)
        items = list(weights.items())
        reads: list[tuple[int, int]] = []  # (thread, buckets applied) as each bucket is read

        def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
            for bucket in (items[:3], items[3:]):
                reads.append((threading.get_ident(), len(sink.held)))
                yield bucket

        broadcast_hf_buckets_via_distributed_impl(
            bucket_iterator=buckets(),
            rollout_engines=engines,
            rollout_engine_lock=lock,
            group_name="inproc",
            model_update_group=group,
            weight_version=1,
        )
        assert engine.weight_version == 1
        assert sink.held == [True, True]
        # read in the caller's thread, each bucket only once the one before was applied
        assert reads == [(threading.get_ident(), 0), (threading.get_ident(), 1)]
        for name, tensor in weights.items():
            assert torch.equal(model[name], tensor), name
        before = {n: t.clone() for n, t in model.items()}
        # version 2 fails in its second bucket (a name the model does not have)
        bad = [("embed.weight", torch.ones(64, 32)), ("no.such.weight", torch.ones(3))]
        with pytest.raises(RuntimeError, match="local") as info:
            broadcast_hf_buckets_via_distributed_impl(
                bucket_iterator=iter([items[:1], bad]),
                rollout_engines=engines,
                rollout_engine_lock=lock,
                group_name="inproc",
                model_update_group=group,
                weight_version=2,
            )
        assert "no.such.weight" in str(info.value)  # refused, yet its broadcast was joined
        assert engine.weight_version == 1
        (failure,) = engine.failures  # the engine's session recorded it
        assert failure.version == 2
        assert "no such parameter" in failure.reason
        for name, tensor in before.items():
            assert torch.equal(model[name], tensor), name
        assert not lock.locked()
    finally:
        disconnect_rollout_engines_from_distributed(
            group_name="inproc", model_update_group=group, rollout_engines=engines
        )
    assert engine.check_health()["groups"] == []


def test_engine_handle_is_the_interface_every_adapter_implements() -> None:
    for adapter in (ObjectHandle, ChannelHandle):
        assert issubclass(adapter, EngineHandle)
    abstract = EngineHandle.__abstractmethods__
    assert {
        "init_weights_update_group",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "destroy_weights_update_group",
        "check_health",
    } <= abstract


class NoTokenEngine:
    """An engine with SGLang's signatures exactly: no ``token`` argument."""

    def __init__(self, engine: AiosyncEngine) -> None:
        self.engine = engine

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str = "nccl",
    ) -> tuple[bool, str]:  # fmt: skip
        return self.engine.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(self, **kwargs: Any) -> tuple[bool, str]:
        return self.engine.update_weights_from_distributed(**kwargs)

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        return self.engine.destroy_weights_update_group(group_name)


def test_engines_without_the_token_argument_join_when_the_token_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "30")
    model = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in mixed_weights().items()}
    engines: list[object] = [NoTokenEngine(AiosyncEngine(ModuleSink(model), name="plain"))]
    with pytest.raises(RuntimeError, match="token"):
        connect_rollout_engines_from_distributed(
            group_name="tokened", rollout_engines=engines, engine_gpu_counts=[1]
        )
    monkeypatch.setenv(distributed.TOKEN_ENV, "0")
    group = connect_rollout_engines_from_distributed(
        group_name="plain", rollout_engines=engines, engine_gpu_counts=[1]
    )
    try:
        weights = mixed_weights(seed=6)
        broadcast_hf_buckets_via_distributed_impl(
            bucket_iterator=iter([list(weights.items())]),
            rollout_engines=engines,
            rollout_engine_lock=None,
            group_name="plain",
            model_update_group=group,
            weight_version=1,
        )
        for name, tensor in weights.items():
            assert torch.equal(model[name], tensor), name
    finally:
        disconnect_rollout_engines_from_distributed(
            group_name="plain", model_update_group=group, rollout_engines=engines
        )


def test_an_in_place_engine_reports_mixed_weights_after_a_failed_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "30")
    model = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in mixed_weights().items()}
    engine = AiosyncEngine(ModuleSink(model), name="in-place")  # not staged
    engines: list[object] = [engine]
    items = list(mixed_weights(seed=7).items())
    bad = [("no.such.weight", torch.ones(3))]
    for version, buckets in ((1, [items[:2], bad]), (2, [items[:4], items[4:]])):
        group = connect_rollout_engines_from_distributed(
            group_name="mixed", rollout_engines=engines, engine_gpu_counts=[1]
        )
        try:
            call = functools.partial(
                broadcast_hf_buckets_via_distributed_impl,
                bucket_iterator=iter(buckets),
                rollout_engines=engines,
                rollout_engine_lock=None,
                group_name="mixed",
                model_update_group=group,
                weight_version=version,
            )
            if version == 1:
                with pytest.raises(RuntimeError, match=r"no\.such\.weight"):
                    call()
                health = engine.check_health()
                assert not health["servable"]
                assert not health["healthy"]
                assert health["weight_version"] is None
            else:
                call()
        finally:
            disconnect_rollout_engines_from_distributed(
                group_name="mixed", model_update_group=group, rollout_engines=engines
            )
    health = engine.check_health()
    assert health["servable"]
    assert health["healthy"]
    assert health["weight_version"] == "2"


def test_weight_versions_need_not_grow_a_lower_one_restarts_the_numbering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "30")
    model = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in mixed_weights().items()}
    engine = AiosyncEngine(ModuleSink(model, staged=True), name="restarts")
    engines: list[object] = [engine]
    group = connect_rollout_engines_from_distributed(
        group_name="restarts", rollout_engines=engines, engine_gpu_counts=[1]
    )
    try:
        for seed, version in ((8, 5), (9, 3), (10, 3)):  # back from a checkpoint, then again
            weights = mixed_weights(seed=seed)
            broadcast_hf_buckets_via_distributed_impl(
                bucket_iterator=iter([list(weights.items())]),
                rollout_engines=engines,
                rollout_engine_lock=None,
                group_name="restarts",
                model_update_group=group,
                weight_version=version,
            )
            assert engine.weight_version == version
            for name, tensor in weights.items():
                assert torch.equal(model[name], tensor), name
        assert engine.failures == []
        assert engine.check_health()["healthy"]
    finally:
        disconnect_rollout_engines_from_distributed(
            group_name="restarts", model_update_group=group, rollout_engines=engines
        )
