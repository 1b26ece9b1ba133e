"""Drop-in names and signatures of NeMo-RL's ``nemo_rl.models.policy.utils``.

Each function keeps the reference's name, signature and semantics and runs on aiosync's own
machinery; the blocking ones drive the async pipeline on a private event loop. The wire is
aiosync's (typed msgpack messages), so the peer of :func:`stream_weights_via_ipc_zmq_impl`
is an aiosync :class:`~aiosync.receiver.WeightReceiver`, not an engine that unpacks objects.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch
import zmq

from aiosync.layout import ALIGNMENT, calculate_aligned_size, iter_named_tensor_buckets, materialize
from aiosync.memory import get_handle_from_tensor, rebuild_cuda_tensor_from_ipc
from aiosync.policy import (
    AUTOMODEL_FACTORY,
    POLICY_WORKER_OVERRIDES,
    configure_dynamo_cache,
    get_gpu_info,
    get_megatron_checkpoint_dir,
    get_runtime_env_for_policy_worker,
    is_vllm_v1_engine_enabled,
    resolve_model_class,
    resolve_policy_worker_cls,
)
from aiosync.runtime import run
from aiosync.sender import SenderConfig, WeightSender
from aiosync.teacher import aggregate_per_sample_handles, ensure_teacher_ipc_buffer
from aiosync.transports.zmq import SenderChannel

log = logging.getLogger(__name__)

TIMEOUT_ENV = "AIOSYNC_TIMEOUT"
"""Environment variable: seconds to wait on the engine in the blocking helpers (default 120)."""


class IPCProtocol(enum.Enum):
    """Names of the stream's closing messages, equal to aiosync's wire tags."""

    COMPLETE = "complete"
    ACK = "ack"


def _run_blocking(main: Any) -> Any:
    """Run an async function to completion from sync code, even under a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run(main)
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(run(main))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="aiosync-compat")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def stream_weights_via_ipc_zmq_impl(
    params_generator: Iterable[tuple[str, torch.Tensor]],
    buffer_size_bytes: int,
    zmq_socket: zmq.Socket[bytes],
    rank: int,
    worker_name: str,
) -> None:
    """Stream ``(name, tensor)`` pairs to an aiosync receiver through two reused buffers.

    ``buffer_size_bytes`` is the total of both ping-pong buffers: each half holds one
    bucket, and packing the next overlaps the engine applying the current one. CUDA tensors
    travel through CUDA IPC buffers on their device, CPU tensors through shared memory.
    ``zmq_socket`` is the caller's connected REQ, DEALER or PAIR socket; it stays open.
    Raises an :class:`~aiosync.errors.AiosyncError` naming the tensor if the engine refuses.
    After a failure a REQ socket may be left waiting for a reply ZMQ will never deliver:
    close it and connect a new one before the next call (``AIOSYNC_TIMEOUT`` bounds waits).
    """
    if buffer_size_bytes < 2 * ALIGNMENT:
        raise ValueError(f"buffer_size_bytes must be at least {2 * ALIGNMENT}")
    iterator = iter(params_generator)
    first = next(iterator, None)
    if first is None:
        device = torch.device("cpu")
        pairs: Iterable[tuple[str, torch.Tensor]] = ()
    else:
        first = (first[0], materialize(first[1]))
        device = first[1].device
        pairs = itertools.chain([first], iterator)
    half = max(ALIGNMENT, buffer_size_bytes // 2 // ALIGNMENT * ALIGNMENT)
    config = SenderConfig(
        buffer_bytes=half,
        num_buffers=2,
        timeout=float(os.environ.get(TIMEOUT_ENV, "120")),
        name=f"{worker_name}[rank {rank}]",
    )

    async def main() -> None:
        channel = SenderChannel.wrap(zmq_socket)
        async with WeightSender(channel, device=device, config=config) as sender:
            report = await sender.send(pairs)
        log.info(
            "%s rank %d streamed version %d: %d tensors, %.1f MB in %.3fs",
            worker_name,
            rank,
            report.version,
            report.tensors,
            report.bytes / 1e6,
            report.seconds,
        )

    _run_blocking(main)


__all__ = [
    "AUTOMODEL_FACTORY",
    "IPCProtocol",
    "POLICY_WORKER_OVERRIDES",
    "aggregate_per_sample_handles",
    "calculate_aligned_size",
    "configure_dynamo_cache",
    "ensure_teacher_ipc_buffer",
    "get_gpu_info",
    "get_handle_from_tensor",
    "get_megatron_checkpoint_dir",
    "get_runtime_env_for_policy_worker",
    "is_vllm_v1_engine_enabled",
    "iter_named_tensor_buckets",
    "rebuild_cuda_tensor_from_ipc",
    "resolve_model_class",
    "resolve_policy_worker_cls",
    "stream_weights_via_ipc_zmq_impl",
]
