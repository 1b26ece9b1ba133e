"""Drop-in names and signatures of NeMo-RL's ``nemo_rl.models.policy.utils``.

Each function keeps the reference's name, signature and semantics and runs on aiosync's own
machinery; the blocking ones drive the async pipeline on a private event loop. The wire is
aiosync's (typed msgpack messages), so the peer of :func:`stream_weights_via_ipc_zmq_impl`
is an aiosync :class:`~aiosync.WeightReceiver`, not an engine that unpacks objects.

Errors keep the builtin types NeMo-RL raises (``ValueError``, ``TypeError``, ``KeyError``,
``AssertionError``, ``RuntimeError``, ``TimeoutError``) and are all
:class:`~aiosync.AiosyncError` too: see :mod:`aiosync.compat.errors`. What NeMo-RL prints
is printed here as well.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import os
from collections.abc import ItemsView, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import zmq

from aiosync import PeerGoneError, SenderConfig, SyncTimeoutError
from aiosync.collectives import init_process_group
from aiosync.compat import stream_cache
from aiosync.compat.colocate import (
    compat_engine_gpu_offsets as _derive_engine_gpu_offsets,  # NeMo-RL's name
)
from aiosync.compat.colocate import (
    connect_colocate_topology,
    send_hf_buckets_via_ipc_actor_impl,
)
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.compat.distributed import (
    check_weight_sync_results as _check_weight_sync_results,  # NeMo-RL's name
)
from aiosync.compat.errors import CompatRuntimeError, CompatTypeError, CompatValueError, translate
from aiosync.compat.policy import (
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
from aiosync.compat.teacher import aggregate_per_sample_handles, ensure_teacher_ipc_buffer
from aiosync.core import layout
from aiosync.core.layout import ALIGNMENT, materialize
from aiosync.planes import cuda_handles
from aiosync.runtime import unwrap_group

log = logging.getLogger(__name__)

TIMEOUT_ENV = "AIOSYNC_TIMEOUT"
"""Environment variable: seconds to wait on the engine in the blocking helpers (default 120)."""


class IPCProtocol(enum.Enum):
    """Names of the stream's closing messages, equal to aiosync's wire tags."""

    COMPLETE = "complete"
    ACK = "ack"


@contextmanager
def _nemo_rl_errors(context: str = "") -> Iterator[None]:
    """Re-raise errors as the compat class of the builtin type NeMo-RL raises there."""
    try:
        yield
    except zmq.Again as exc:  # a caller's socket with RCVTIMEO/SNDTIMEO set
        raise SyncTimeoutError(f"{context}: ZMQ timed out waiting on the engine") from exc
    except zmq.ZMQError as exc:
        hint = ""
        if exc.errno == zmq.EFSM:
            hint = " (a REQ socket left mid-request by an earlier failure: connect a new one)"
        raise CompatRuntimeError(
            f"{context}: ZMQ error during weight streaming: {exc} (errno {exc.errno}){hint}"
        ) from exc
    except Exception as exc:
        cause = unwrap_group(exc)
        compat = translate(cause, context) if isinstance(cause, Exception) else cause
        if compat is exc:
            raise
        raise compat from exc


def calculate_aligned_size(size_bytes: int, alignment: int = 512) -> int:
    """Round ``size_bytes`` up to a multiple of ``alignment`` (default 512 bytes).

    Raises ``ValueError`` (also an ``AiosyncError``) for a negative size or a non-positive
    alignment.
    """
    with _nemo_rl_errors():
        return layout.calculate_aligned_size(size_bytes, alignment)


def iter_named_tensor_buckets(
    params_generator: Iterable[tuple[str, torch.Tensor]], buffer_size_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into buckets of at most ``buffer_size_bytes`` each.

    Tensors with a ``wait()`` (async DTensor redistributes) are waited on before sizing, so
    every yielded tensor is materialized. A tensor larger than the budget gets a bucket of
    its own. Raises ``ValueError`` for a non-positive budget (at the call) and ``TypeError``
    for an item that is not a tensor (while iterating); both are also ``AiosyncError``.
    """
    with _nemo_rl_errors():
        buckets = layout.iter_named_tensor_buckets(params_generator, buffer_size_bytes)
    return _translated(buckets)


def _translated(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[Any]:
    with _nemo_rl_errors():
        yield from buckets


def get_handle_from_tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Export a CUDA tensor for CUDA IPC; open it with :func:`rebuild_cuda_tensor_from_ipc`.

    Raises ``ValueError`` (also an ``AiosyncError``) for a tensor that is not on CUDA.
    """
    with _nemo_rl_errors():
        return cuda_handles.get_handle_from_tensor(tensor)


def rebuild_cuda_tensor_from_ipc(cuda_ipc_handle: tuple[Any, ...], device_id: int) -> torch.Tensor:
    """Open, on local CUDA device ``device_id``, a tensor another process exported.

    CUDA's own failures (a handle from this very process, say) are raised as
    ``RuntimeError`` (also an ``AiosyncError``).
    """
    with _nemo_rl_errors():
        return cuda_handles.rebuild_cuda_tensor_from_ipc(cuda_ipc_handle, device_id)


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
    travel through CUDA IPC buffers on their device (packed on the caller's current CUDA
    stream), CPU tensors through shared memory.

    A list, tuple or ``.items()`` of plain tensors is read as it is, twice: the sender
    reads the manifest first, so the engine replays the last call's checked layout and the
    next call's ``begin`` goes before the read, as :class:`~aiosync.WeightSender` does for
    any list of pairs (each pair sent as given, a tied tensor under each of its names). A
    generator (NeMo-RL's usual argument) streams as it comes.

    The sender, its buffers, their IPC handles and the engine session are kept for the
    next call on the same socket with the same buffer size and device, so a repeated call
    pays no set-up; they are released when the socket is closed, when a call brings
    another size or device, or by :func:`release_ipc_zmq_streams`.

    ``zmq_socket`` is the caller's REQ or DEALER socket, connected to the receiver; it
    stays open. Those are the socket types that can talk to the receiver's ROUTER socket:
    a PAIR socket only ever talks to another PAIR, so it is refused with a ``ValueError``.
    After a failure a REQ socket may be left waiting for a reply ZMQ will never deliver:
    close it and connect a new one before the next call (``AIOSYNC_TIMEOUT`` bounds waits).

    As in NeMo-RL, rank 0 prints how many groups (buckets) it packed. Errors keep NeMo-RL's
    types and are all :class:`~aiosync.AiosyncError` too, naming the worker and rank, and
    the tensor where one is involved: ``TimeoutError`` when the engine does not answer in
    time, ``RuntimeError`` when it goes away, refuses a tensor (a name or shape its model
    lacks, say) or a ZMQ call fails, ``ValueError`` for a bad argument or a tensor that
    cannot be sent at all (on the meta device, say), and ``TypeError`` for an item that is
    not a tensor.
    """
    context = f"{worker_name} (rank {rank})"
    if buffer_size_bytes < 2 * ALIGNMENT:
        raise CompatValueError(f"buffer_size_bytes must be at least {2 * ALIGNMENT}")
    if not isinstance(zmq_socket, zmq.Socket):
        raise CompatTypeError(f"zmq_socket must be a zmq socket, not {type(zmq_socket).__name__}")
    socket_type = zmq.SocketType(int(zmq_socket.getsockopt(zmq.TYPE)))
    if socket_type not in (zmq.REQ, zmq.DEALER):
        raise CompatValueError(
            f"{context}: zmq_socket must be a REQ or DEALER socket connected to the engine's "
            f"ROUTER socket; a {socket_type.name} socket cannot talk to it"
        )
    with _nemo_rl_errors(context):
        pairs: Iterable[tuple[str, torch.Tensor]]
        kept = _rereadable(params_generator)
        if kept is not None:  # a list or .items(): the sender reads its manifest first
            pairs = kept
            device = kept[0][1].device if kept else torch.device("cpu")
        else:
            iterator = iter(params_generator)
            first = next(iterator, None)
            if first is None:
                device = torch.device("cpu")
                pairs = ()
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
        report = _send_cached(zmq_socket, device, config, pairs)
    log.info(
        "%s streamed version %d: %d tensors, %.1f MB in %.3fs",
        context,
        report.version,
        report.tensors,
        report.bytes / 1e6,
        report.seconds,
    )
    if rank == 0:
        print(f"{worker_name}: Packed {report.buckets} groups of tensors", flush=True)


def _rereadable(params: Iterable[Any]) -> list[tuple[str, torch.Tensor]] | None:
    """``params`` as a list, if it is a list, tuple or ``.items()`` of (name, tensor) pairs.

    Those can be read twice: the sender then reads the manifest before streaming, so the
    engine replays the last version's checked layout and the ``begin`` may go before the
    read. A generator, or anything holding other values (async results to wait for),
    streams as it comes.
    """
    if not isinstance(params, list | tuple | ItemsView):
        return None
    pairs = list(params)
    for pair in pairs:
        plain = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
        if not plain or type(pair[1]) not in (torch.Tensor, torch.nn.Parameter):
            return None
    return pairs


class _Replayable:
    """The pairs of one call, the first ones kept so that a failed send can start again.

    Pairs are kept while they fit in ``limit`` bytes (the sender's buffers): the packer
    cannot get further ahead of the engine's first ack than that, so a session found gone
    at the version's start leaves every pair read so far here.
    """

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], limit: int) -> None:
        self._pairs = iter(pairs)
        self._kept: collections.deque[tuple[str, torch.Tensor]] = collections.deque()
        self._replay: collections.deque[tuple[str, torch.Tensor]] = collections.deque()
        self._room = limit
        self.keeping = True

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        item = self._replay.popleft() if self._replay else next(self._pairs)
        if self.keeping:
            self._room -= _nbytes(item[1])
            self.keeping = self._room >= 0
            self._kept.append(item)
            if not self.keeping:
                self._kept.clear()
        return item

    def rewind(self) -> bool:
        """Start again from the first pair; False when the first ones were let go."""
        if not self.keeping:
            return False
        self._replay.extendleft(reversed(self._kept))
        self._kept.clear()
        return True


def _nbytes(tensor: object) -> int:
    return tensor.nbytes if isinstance(tensor, torch.Tensor) else 0


def _send_cached(
    zmq_socket: zmq.Socket[bytes],
    device: torch.device,
    config: SenderConfig,
    pairs: Iterable[tuple[str, torch.Tensor]],
) -> Any:
    """Send through the socket's cached sender; a gone session is renewed once if it can be.

    An engine forgets a session it has not heard from for its ``session_timeout`` (a REQ
    socket cannot send keepalives between calls): then, if the pairs read so far were kept, a
    fresh sender (a new session) sends the version again from the first pair.
    """
    replay: list[tuple[str, torch.Tensor]] | _Replayable  # a list is read twice as it is
    if isinstance(pairs, list):
        replay = pairs
    else:
        replay = _Replayable(pairs, config.num_buffers * config.buffer_bytes)
    stream, fresh = stream_cache.cached_stream(zmq_socket, device, config)
    try:
        return stream.send(replay, config.timeout)
    except PeerGoneError:
        stream_cache.release_streams(zmq_socket)
        if fresh or not (isinstance(replay, list) or replay.rewind()):
            raise
    log.info("the engine forgot the cached session; opening a new one")
    stream, _ = stream_cache.cached_stream(zmq_socket, device, config)
    return stream.send(replay, config.timeout)


def release_ipc_zmq_streams(zmq_socket: zmq.Socket[bytes] | None = None) -> int:
    """Release what :func:`stream_weights_via_ipc_zmq_impl` keeps for ``zmq_socket`` (or all).

    Says goodbye to the engine (unless the socket is closed), frees the buffers and their
    IPC handles and ends the private loop thread. Returns how many cached senders it
    released. Calls on a closed socket, or with another buffer size, release by themselves.
    """
    return stream_cache.release_streams(zmq_socket)


__all__ = [
    "AUTOMODEL_FACTORY",
    "IPCProtocol",
    "POLICY_WORKER_OVERRIDES",
    "_check_weight_sync_results",
    "_derive_engine_gpu_offsets",
    "aggregate_per_sample_handles",
    "broadcast_hf_buckets_via_distributed_impl",
    "calculate_aligned_size",
    "configure_dynamo_cache",
    "connect_colocate_topology",
    "connect_rollout_engines_from_distributed",
    "disconnect_rollout_engines_from_distributed",
    "ensure_teacher_ipc_buffer",
    "get_gpu_info",
    "get_handle_from_tensor",
    "get_megatron_checkpoint_dir",
    "get_runtime_env_for_policy_worker",
    "init_process_group",
    "is_vllm_v1_engine_enabled",
    "iter_named_tensor_buckets",
    "rebuild_cuda_tensor_from_ipc",
    "release_ipc_zmq_streams",
    "resolve_model_class",
    "resolve_policy_worker_cls",
    "send_hf_buckets_via_ipc_actor_impl",
    "stream_weights_via_ipc_zmq_impl",
]
