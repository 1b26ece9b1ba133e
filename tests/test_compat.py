"""The compatibility module keeps the reference's names and signatures."""

from __future__ import annotations

import inspect

import pytest

from aiosync import wire
from aiosync.compat import nemo_rl

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


def test_stream_rejects_a_buffer_too_small_for_two_halves() -> None:
    with pytest.raises(ValueError, match="at least 1024"):
        nemo_rl.stream_weights_via_ipc_zmq_impl([], 1000, None, 0, "w")  # type: ignore[arg-type]
