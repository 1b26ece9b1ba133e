"""The engine's side of the collective data plane (see :mod:`aiosync.planes.collective`).

:class:`CollectiveReceiverPlane` joins the trainer's side group from the hello's
:class:`~aiosync.core.wire.CollectivePlaneSpec` (checked first as hostile input by
:func:`check_spec`) and receives each bucket in :meth:`CollectiveReceiverPlane.view`
(NCCL: queued on the GPU, no host wait; :meth:`CollectiveReceiverPlane.settle` is the
version's one wait, before the engine calls it whole).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch._C._distributed_c10d import Store

from aiosync.collectives import ops
from aiosync.collectives.executor import Deadline, GroupExecutor, collective_error
from aiosync.collectives.file_store import check_store_path, open_file_store
from aiosync.collectives.ordered import OrderedBroadcasts
from aiosync.collectives.rank_proofs import is_secret
from aiosync.collectives.rendezvous import is_token, valid_host
from aiosync.core.errors import AiosyncError, ProtocolError, SyncTimeoutError, UsageError
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import Limits
from aiosync.core.wire import CollectivePlaneSpec
from aiosync.planes.base import BucketContext, ReceiverPlane
from aiosync.planes.collective_meeting import dialer_for, forgetting, join_engine

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
MAX_WORLD = 1 << 14
MAX_TIMEOUT_MS = 24 * 3600 * 1000
_GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_SKIPPED_SLOTS = 1 << 16
"""Most tensors a refused bucket may ask this engine to receive (per-tensor mode)."""
DEFAULT_MAX_TIMEOUT = 60.0
"""The longest a peer's plane timeout is taken, in seconds, unless the engine says (as
:class:`~aiosync.ReceiverConfig`'s default stream and session timeouts)."""


def joined_group(
    executor: GroupExecutor, joined: concurrent.futures.Future[None], name: str
) -> torch.distributed.ProcessGroup:
    """The group once joined (on the group's thread, so the join has ended by then)."""
    error = joined.exception() if joined.done() else None
    if error is not None:
        raise collective_error(error, f"rendezvous of group {name}", ())
    if executor.group is None:
        raise AiosyncError(f"group {name} was never joined")
    return executor.group


def check_spec(spec: CollectivePlaneSpec, limits: Limits | None = None) -> None:
    """Refuse a collective plane spec a peer could abuse (raises :class:`ProtocolError`)."""
    limits = limits or Limits()
    problems = []
    if spec.backend not in BACKENDS:
        problems.append(f"backend {spec.backend!r} is not one of {BACKENDS}")
    try:
        valid_host(spec.host)
    except ValueError as exc:
        problems.append(str(exc))
    if spec.store_path:
        problem = check_store_path(spec.store_path)
        if problem is not None:
            problems.append(problem)
        if spec.port != 0:
            problems.append(f"port {spec.port} beside a rendezvous file")
    elif not 0 < spec.port < 65536:
        problems.append(f"port {spec.port} out of range")
    if not is_token(spec.token):
        problems.append("malformed token")
    if not is_secret(spec.secret):
        problems.append("no well-formed rank secret (a trainer older than this engine?)")
    if not _GROUP_NAME.fullmatch(spec.group):
        problems.append("group name must be 1-128 of [A-Za-z0-9_.-]")
    if not 2 <= spec.world_size <= MAX_WORLD:
        problems.append(f"world size {spec.world_size} not in [2, {MAX_WORLD}]")
    if not 1 <= spec.count <= limits.max_buffers or spec.capacity <= 0:
        problems.append(f"{spec.count} buffers of {spec.capacity} bytes")
    elif spec.count * spec.capacity > limits.max_session_bytes:
        problems.append(f"{spec.count * spec.capacity} bytes of buffers (too many)")
    if not 0 < spec.timeout_ms <= MAX_TIMEOUT_MS:
        problems.append(f"timeout {spec.timeout_ms} ms out of range")
    if problems:
        raise ProtocolError("collective plane refused: " + "; ".join(problems))


class CollectiveReceiverPlane(ReceiverPlane):
    """An engine's side: joins the group (next free rank) and receives each bucket.

    Opening returns at once; the rendezvous runs on the group's thread, so a trainer that
    says hello to several engines in turn is never blocked by the first. ``view`` (called
    when the bucket message arrives, in a worker thread: this plane does not say
    ``views_at_once``, so its buckets are never applied on the event loop) posts the
    receive. Gloo: it returns once the bytes are in place. NCCL: it returns once the
    receive is queued (from the calling thread when the group's thread is idle: no
    hand-over)
    (after the copies out of that buffer's previous bucket, by CUDA event), with the
    calling thread's stream made to wait for it; the sink's copies follow on the GPU, and
    the host waits once per version, in :meth:`settle`, under the deadline (a watcher
    aborts the group if a receive is not done by its own). Buffers are allocated on
    first use.

    The peer's ``timeout_ms`` is taken up to ``max_timeout`` seconds, the engine's own
    (the receiver passes the longer of its stream and session timeouts). A rendezvous file
    is checked before anything starts; a ``TCPStore`` is reached through a dialer that
    :meth:`close`, or the deadline, cuts (see :mod:`aiosync.planes.collective_meeting`).
    """

    joins_all = True  # every rank joins every broadcast: refused buckets are skipped through

    def __init__(
        self,
        spec: CollectivePlaneSpec,
        device: torch.device,
        limits: Limits | None = None,
        *,
        max_timeout: float = DEFAULT_MAX_TIMEOUT,
    ) -> None:
        check_spec(spec, limits)
        self._spec = spec
        self._timeout = min(spec.timeout_ms / 1000, max_timeout)
        self._stopped = threading.Event()
        self._dialer = dialer_for(spec)
        if spec.store_path:  # checked on disk now: a bad path refuses the hello
            open_file_store(spec.store_path, timedelta(seconds=self._timeout))
        if spec.backend == "nccl":
            if device.type != "cuda":
                raise ProtocolError("an NCCL plane needs an engine on a CUDA device")
            self._device = device
        else:
            self._device = torch.device("cpu")
        self._buffers: dict[int, torch.Tensor] = {}
        self._expected: dict[int, list[TensorSpec]] = {}
        self.rank: int | None = None
        self._executor = GroupExecutor(spec.group, join_timeout=self._timeout)
        self._executor.start()
        self._ordered: OrderedBroadcasts | None = None
        if spec.backend == "nccl":
            self._ordered = OrderedBroadcasts(self._executor, device, peers=("the trainer",))
        self._copied: dict[int, torch.cuda.Event] = {}
        self.events: list[bytes] = [b"collective"] if self._ordered is not None else []
        """Non-empty when copies are ordered by events (see :mod:`aiosync.planes.cuda_order`):
        the receiver then lets sinks skip their per-bucket device wait. The trainer's
        collective plane ignores the value."""
        self._joined = self._executor.submit(self._join)

    def _join(self) -> None:
        spec, dialer = self._spec, self._dialer
        if dialer is not None:
            dialer.cut_after(self._timeout)  # torch's client may ignore its own timeout
            base: Callable[[timedelta], Store] = dialer.connect
        else:
            base = functools.partial(open_file_store, spec.store_path)
        try:
            join = functools.partial(
                join_engine, spec, self._executor, self._device, base, self._stopped,
                self._timeout,
            )  # fmt: skip
            self.rank = forgetting(join)()
        finally:
            if dialer is not None:
                dialer.done()
        log.info("joined group %s as rank %d of %d", spec.group, self.rank, spec.world_size)

    def expect(self, index: int, specs: list[TensorSpec]) -> None:
        """The (checked) specs of the bucket about to arrive in ``index`` (per-tensor mode)."""
        self._expected[index] = specs

    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        """Receive bucket ``index`` (``used`` bytes) and return its bytes; blocking.

        NCCL: the bytes are there for work queued next on this thread's stream, and
        ``context`` asks for the copies out to stay on it (beside the next receive).
        """
        spec = self._spec
        if not 0 <= index < spec.count or not 0 <= used <= spec.capacity:
            raise ProtocolError(f"bucket {index} of {used} bytes is outside the plane")
        buffer = self._buffers.get(index)
        if buffer is None:
            buffer = torch.empty(spec.capacity, dtype=torch.uint8, device=self._device)
            if self._ordered is not None:
                self._ordered.hold(buffer)
            self._buffers[index] = buffer
        data = buffer[:used]
        deadline = Deadline.after(self._timeout)
        parts = [data]
        if spec.per_tensor:
            specs = self._expected.pop(index, None)
            if specs is None:
                raise UsageError("per-tensor plane: the receiver did not pass the bucket's specs")
            parts = [data[s.offset : s.offset + s.nbytes] for s in specs if s.nbytes]
        what = f"receive into buffer {index}"
        ordered = self._ordered
        if ordered is None:
            job = lambda: ops.broadcast_many(self._group(), parts, 0, deadline)  # noqa: E731
            self._executor.call(job, deadline=deadline, what=what)
            return data
        after = self._copied.pop(index, None)
        step: Callable[[], torch.cuda.Event] = lambda: ordered.step(  # noqa: E731
            self._group(), parts, after, deadline, what
        )
        received = self._executor.call_here(step, deadline=deadline, what=what)
        torch.cuda.current_stream(self._device).wait_event(received)
        if context is not None:
            context.one_stream = True  # the copies out run beside the next receive
        return data

    def skip(self, index: int, used: int, slots: list[tuple[int, int]]) -> None:
        """Join the broadcast of a bucket this engine refused, into buffer ``index``; drop it.

        Every rank takes part in every broadcast of a group, so an engine that refuses a
        bucket (or its whole version) still receives it: the other engines complete, and
        this one keeps its previous version. ``slots``: each tensor's ``(offset, nbytes)``
        as the bucket message gives them (per tensor, one receive each; checked first).
        """
        spec = self._spec
        if spec.per_tensor:
            if len(slots) > MAX_SKIPPED_SLOTS or any(
                offset < 0 or nbytes < 0 or offset + nbytes > used for offset, nbytes in slots
            ):
                raise ProtocolError(f"a refused bucket's {len(slots)} slots lie outside it")
            self._expected[index] = [
                TensorSpec(f"skipped-{i}", "uint8", (nbytes,), offset, nbytes)
                for i, (offset, nbytes) in enumerate(slots)
            ]
        self.view(index, used)  # no context: nothing is copied out of a skipped bucket
        self.applied(index)  # the next receive into the buffer follows this one

    @contextmanager
    def applying(self, index: int) -> Iterator[None]:
        """Around one bucket's apply (see :mod:`aiosync.planes.cuda_order`): nothing to set."""
        yield

    def applied(self, index: int) -> None:
        """The bucket's copies out of buffer ``index`` are queued on this thread's stream."""
        if self._ordered is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self._device))
            self._copied[index] = event

    def settle(self) -> None:
        """Block until every receive queued so far is done (before the version is whole).

        Raises the group's error if one failed, or :class:`SyncTimeoutError` (aborting
        the group) past the plane's timeout. Gloo: nothing is left to wait for.
        """
        if self._ordered is not None:
            self._ordered.watch.settle(Deadline.after(self._timeout))

    def _group(self) -> torch.distributed.ProcessGroup:
        return joined_group(self._executor, self._joined, self._spec.group)

    def close(self) -> None:
        """Leave the group (without waiting for a blocked collective to end).

        A receive still queued on the GPU (a trainer gone mid-broadcast) breaks the group
        first, so the NCCL communicator is aborted and no kernel is left waiting. A join
        still under way stops: its wait for the other ranks ends, and its connections to
        a ``TCPStore`` are cut, so its thread and descriptors go with the session.
        """
        self._stopped.set()
        if self._dialer is not None:
            self._dialer.cut()
        if self._ordered is not None:
            if self._ordered.watch.pending:
                error = SyncTimeoutError(f"group {self._spec.group} closed with a receive queued")
                self._executor.fail(error)
            self._ordered.close()
        self._executor.close(wait=False)
        self._buffers.clear()
