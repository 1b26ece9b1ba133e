"""The compatibility module keeps the reference's names and signatures."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import zmq

from aiosync import (
    AiosyncError,
    ModuleSink,
    PeerGoneError,
    RejectedError,
    SyncTimeoutError,
    WeightReceiver,
)
from aiosync.compat import errors, nemo_rl
from aiosync.core import wire

# Parameter names (and defaults) of the reference API, for the functions built so far.
SIGNATURES: dict[str, list[tuple[str, object]]] = {
    "resolve_policy_worker_cls": [("default_cls", None), ("config", None)],
    "resolve_model_class": [("model_name", None)],
    "is_vllm_v1_engine_enabled": [],
    "get_gpu_info": [("model", None)],
    "configure_dynamo_cache": [],
    "get_runtime_env_for_policy_worker": [("policy_worker_name", None)],
    "get_megatron_checkpoint_dir": [],
    "get_handle_from_tensor": [("tensor", None)],
    "ensure_teacher_ipc_buffer": [
        ("storage", None),
        ("handle", None),
        ("num_microbatches", None),
        ("batch_size", None),
        ("seq_len", None),
        ("vocab_size", None),
        ("dtype", None),
        ("device", None),
    ],
    "aggregate_per_sample_handles": [("worker_results", None)],
    "calculate_aligned_size": [("size_bytes", None), ("alignment", 512)],
    "stream_weights_via_ipc_zmq_impl": [
        ("params_generator", None),
        ("buffer_size_bytes", None),
        ("zmq_socket", None),
        ("rank", None),
        ("worker_name", None),
    ],
    "rebuild_cuda_tensor_from_ipc": [("cuda_ipc_handle", None), ("device_id", None)],
    "iter_named_tensor_buckets": [("params_generator", None), ("buffer_size_bytes", None)],
    "init_process_group": [
        ("backend", None),
        ("init_method", None),
        ("timeout", None),
        ("world_size", -1),
        ("rank", -1),
        ("store", None),
        ("group_name", None),
        ("pg_options", None),
    ],
    "_check_weight_sync_results": [("results", None)],
    # keyword-only in the reference (checked in tests/compat/test_compat_distributed.py too)
    "connect_rollout_engines_from_distributed": [
        ("group_name", None),
        ("rollout_engines", None),
        ("engine_gpu_counts", None),
    ],
    "disconnect_rollout_engines_from_distributed": [
        ("group_name", None),
        ("model_update_group", None),
        ("rollout_engines", None),
    ],
    "broadcast_hf_buckets_via_distributed_impl": [
        ("bucket_iterator", None),
        ("rollout_engines", None),
        ("rollout_engine_lock", None),
        ("group_name", None),
        ("model_update_group", None),
        ("weight_version", None),
    ],
    "_derive_engine_gpu_offsets": [("engine_gpu_counts", None)],
    # keyword-only in the reference (tests/processes/test_topology_gloo.py runs them across ranks)
    "connect_colocate_topology": [
        ("engine_gpu_counts", None),
        ("engine_gpu_offsets", None),
        ("worker_state", None),
    ],
    "send_hf_buckets_via_ipc_actor_impl": [
        ("bucket_iterator", None),
        ("rollout_engines", None),
        ("worker_state", None),
        ("weight_version", None),
    ],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_reference_function_has_its_signature(name: str) -> None:
    function = getattr(nemo_rl, name)
    params = inspect.signature(function).parameters.values()
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == SIGNATURES[name]
    assert function.__doc__, f"{name} has no docstring"
    assert name in nemo_rl.__all__


def test_data_names_exist() -> None:
    assert isinstance(nemo_rl.AUTOMODEL_FACTORY, dict)
    assert isinstance(nemo_rl.POLICY_WORKER_OVERRIDES, dict)


def test_ipc_protocol_values_match_the_wire_tags() -> None:
    assert nemo_rl.IPCProtocol.COMPLETE.value == "complete"
    assert nemo_rl.IPCProtocol.ACK.value == "ack"
    assert wire.Complete.__struct_config__.tag == nemo_rl.IPCProtocol.COMPLETE.value
    assert wire.Ack.__struct_config__.tag == nemo_rl.IPCProtocol.ACK.value


# --- errors: NeMo-RL's builtin types, and AiosyncErrors too ----------------------------------


@pytest.mark.parametrize(
    ("compat", "builtin"),
    [
        (errors.CompatValueError, ValueError),
        (errors.CompatTypeError, TypeError),
        (errors.CompatKeyError, KeyError),
        (errors.CompatAssertionError, AssertionError),
        (errors.CompatRuntimeError, RuntimeError),
        (errors.CompatImportError, ImportError),
        (errors.CompatPeerGoneError, RuntimeError),
        (errors.CompatRejectedError, RuntimeError),
        (errors.CompatProtocolError, RuntimeError),
    ],
)
def test_every_compat_error_is_both_kinds(compat: type[Exception], builtin: type) -> None:
    error = compat("what went wrong")
    assert isinstance(error, builtin)
    assert isinstance(error, AiosyncError)
    assert str(error) == "what went wrong"  # a KeyError would quote it


def test_translate_keeps_the_type_and_the_context() -> None:
    value = errors.translate(ValueError("bad"), "policy (rank 0)")
    assert type(value) is errors.CompatValueError
    assert str(value) == "policy (rank 0): bad"
    assert type(errors.translate(KeyError("k"))) is errors.CompatKeyError
    assert str(errors.translate(KeyError("k"))) == "k"
    gone = errors.translate(PeerGoneError("engine closed", peer="ipc://x", version=3))
    assert isinstance(gone, PeerGoneError)
    assert isinstance(gone, RuntimeError)
    assert (gone.peer, gone.version) == ("ipc://x", 3)
    rejected = errors.translate(RejectedError("no such tensor", tensor="w"))
    assert isinstance(rejected, RejectedError)
    assert isinstance(rejected, RuntimeError)
    assert rejected.tensor == "w"
    timeout = SyncTimeoutError("no ack")
    assert errors.translate(timeout) is timeout  # already a TimeoutError
    other = OSError("disk")
    assert errors.translate(other) is other  # not a type NeMo-RL raises on purpose


def both(error: BaseException, builtin: type) -> None:
    assert isinstance(error, builtin), type(error).__mro__
    assert isinstance(error, AiosyncError), type(error).__mro__


def test_stream_rejects_a_buffer_too_small_for_two_halves() -> None:
    with pytest.raises(ValueError, match="at least 1024") as info:
        nemo_rl.stream_weights_via_ipc_zmq_impl([], 1000, None, 0, "w")  # type: ignore[arg-type]
    both(info.value, ValueError)


def test_stream_refuses_what_is_not_a_socket() -> None:
    with pytest.raises(TypeError, match="zmq socket") as info:
        nemo_rl.stream_weights_via_ipc_zmq_impl([], 4096, object(), 0, "w")  # type: ignore[arg-type]
    both(info.value, TypeError)


def test_stream_refuses_a_pair_socket_which_cannot_talk_to_the_engine() -> None:
    ctx = zmq.Context()
    pair = ctx.socket(zmq.PAIR)
    try:
        with pytest.raises(ValueError, match=r"REQ or DEALER.*PAIR") as info:
            nemo_rl.stream_weights_via_ipc_zmq_impl([], 4096, pair, 0, "policy")
        both(info.value, ValueError)
    finally:
        pair.close(linger=0)
        ctx.term()


def test_layout_and_handle_helpers_raise_both_kinds() -> None:
    with pytest.raises(ValueError, match="negative") as info:
        nemo_rl.calculate_aligned_size(-1)
    both(info.value, ValueError)
    with pytest.raises(ValueError, match="positive") as info:
        nemo_rl.iter_named_tensor_buckets([], 0)  # at the call, not on first next()
    both(info.value, ValueError)
    buckets = nemo_rl.iter_named_tensor_buckets([("w", "not a tensor")], 1024)  # type: ignore[list-item]
    with pytest.raises(TypeError) as info:
        list(buckets)
    both(info.value, TypeError)
    with pytest.raises(ValueError, match="CUDA") as info:
        nemo_rl.get_handle_from_tensor(torch.zeros(2))
    both(info.value, ValueError)


def test_bucket_helpers_still_bucket() -> None:
    pairs = [(f"t{i}", torch.zeros(64, dtype=torch.uint8)) for i in range(5)]
    buckets = list(nemo_rl.iter_named_tensor_buckets(pairs, 128))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert nemo_rl.calculate_aligned_size(513) == 1024


# --- the stream: what NeMo-RL prints, and its error types ---------------------------------


def dealer(endpoint: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    return ctx, sock


async def test_stream_prints_what_nemo_rl_prints_and_maps_refusals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    async with WeightReceiver(ModuleSink(engine)) as receiver:
        ctx, sock = dealer(receiver.endpoint)
        try:
            for rank in (0, 1):
                await anyio.to_thread.run_sync(
                    nemo_rl.stream_weights_via_ipc_zmq_impl,
                    trainer.named_parameters(),
                    4096,
                    sock,
                    rank,
                    "policy",
                )
            out = capsys.readouterr().out
            assert re.fullmatch(r"policy: Packed \d+ groups of tensors\n", out), out  # rank 0 only
            bad = [("0.weight", torch.ones(2, 2))]
            with pytest.raises(RuntimeError, match=r"policy \(rank 3\).*0\.weight") as info:
                await anyio.to_thread.run_sync(
                    nemo_rl.stream_weights_via_ipc_zmq_impl, bad, 4096, sock, 3, "policy"
                )
            both(info.value, RuntimeError)
            assert isinstance(info.value, AiosyncError)
            assert info.value.tensor == "0.weight"
        finally:
            sock.close(linger=0)
            ctx.term()
    assert receiver.current_version == 1


def test_a_list_or_items_of_plain_tensors_is_read_twice_anything_else_streams() -> None:
    weights = {"a": torch.zeros(2), "b": torch.nn.Parameter(torch.ones(3))}
    assert nemo_rl._rereadable(weights.items()) == list(weights.items())
    assert nemo_rl._rereadable(list(weights.items())) == list(weights.items())
    assert nemo_rl._rereadable(iter(weights.items())) is None  # a generator: as it comes
    assert nemo_rl._rereadable(weights) is None  # a mapping is not pairs
    assert nemo_rl._rereadable([("a", "not a tensor")]) is None
    assert nemo_rl._rereadable([("a", torch.zeros(1), "extra")]) is None

    class Waited(torch.Tensor):  # a subclass (an async result, a DTensor): streamed
        pass

    assert nemo_rl._rereadable([("a", torch.zeros(1).as_subclass(Waited))]) is None


@pytest.mark.parametrize("kind", ["items", "generator"])
async def test_stream_of_a_list_reads_its_manifest_and_begins_before_the_read(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiosync.trainer.sender as sender_module

    early: list[bool] = []
    own = sender_module.WeightSender._begin_early

    async def watched(self: Any, *args: Any) -> Any:
        out = await own(self, *args)
        early.append(out is not None)
        return out

    monkeypatch.setattr(sender_module.WeightSender, "_begin_early", watched)
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    async with WeightReceiver(ModuleSink(engine)) as receiver:
        ctx, sock = dealer(receiver.endpoint)
        try:
            for step in range(3):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(step + 1)
                weights = dict(trainer.named_parameters())
                pairs = weights.items() if kind == "items" else iter(weights.items())
                await anyio.to_thread.run_sync(
                    nemo_rl.stream_weights_via_ipc_zmq_impl, pairs, 4096, sock, 1, "policy"
                )
                for name, value in engine.state_dict().items():
                    assert torch.equal(value, weights[name])
        finally:
            nemo_rl.release_ipc_zmq_streams(sock)
            sock.close(linger=0)
            ctx.term()
        assert receiver.current_version == 2
    # .items() is read twice: from the second call the begin goes before the read
    assert early == ([False, True, True] if kind == "items" else [False, False, False])


async def test_stream_with_no_engine_is_a_builtin_error_naming_the_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(nemo_rl.TIMEOUT_ENV, "1")
    ctx, sock = dealer(f"ipc://{tmp_path / 'nobody.sock'}")
    try:
        with pytest.raises(AiosyncError, match=r"policy \(rank 2\)") as info:
            await anyio.to_thread.run_sync(
                nemo_rl.stream_weights_via_ipc_zmq_impl,
                [("w", torch.zeros(4))],
                4096,
                sock,
                2,
                "policy",
            )
        assert isinstance(info.value, RuntimeError | TimeoutError), type(info.value).__mro__
    finally:
        sock.close(linger=0)
        ctx.term()
