"""A bucket's device copies, queued by address and spread over two streams.

Both ends of the CUDA planes copy a bucket tensor by tensor: the trainer packs its tensors
into a buffer, the engine copies them out into its model. Queued on one stream, each
``cudaMemcpyAsync`` waits for the last wave of the one before it, leaving part of the GPU
idle at every boundary: on an H200, Llama-3-8B's 291 tensors take 1.12x one flat copy of
the same bytes that way. Dealt over the caller's stream and one side stream, forked from
it and joined back into it, the copies overlap those tails and take 1.03x; more streams
gain nothing more (``python -m benchmarks.copy_paths``, ``docs/benchmarks.md``). To
all other work the batch stays on the caller's stream: it starts after what was queued
there before and what is queued there after starts after the whole batch.

Where the caller's stream waits on another process's event (the trainer's packing on an
engine's ``applied``, an engine's copies on the trainer's ``packed``), the planes wait
through :func:`wait_gate`, and the side stream waits on the same events before its fork.
Two processes on one GPU take turns on it; a stream of the running process blocked on an
event of its own process keeps that process's turn, so the GPU idles until the turn ends
(1.1-1.3 ms gaps on an H200, measured), whereas a wait on the other process's event lets
the GPU switch at once. With the gates, the side stream's own wait is only ever on work
that can already run.

A batch that recurs with the very same addresses every version (an engine reading a
direct bucket out of a trainer's parameters) may ask to run as one CUDA graph
(``BucketContext.graph``; :class:`~aiosync.planes.cuda_graphs.CopyGraph`): from its second
time on, the copies are memcpy nodes in :data:`GRAPH_LANES` independent chains, launched with
one call. No host time per copy, and the chains overlap more tails than two streams do
(Llama-3-8B's 291 tensors on an H200: 1.015x one flat copy, against 1.05x over two
streams and 1.12x on one). Making a graph costs about 10 µs a copy, once. The graph runs
on the caller's stream as one step, and only when every gate of the batch has fired (see
:meth:`DeviceCopies._may_graph`). Other batches are not graphs: packed buckets between
two processes on one GPU mostly wait on pending gates, and graphs made at random versions
there only added their making to those versions; beside a collective they gained nothing.

Spreading helps where copies are bound by the GPU's own memory. Where a collective runs on
the same GPU meanwhile, the second stream only takes bandwidth from it: there the plane
asks for the next batch on one stream (``BucketContext.one_stream``). Measured on two H200s:
spreading made a flattened NCCL broadcast 1.21x the raw one instead of 1.16x.

These hints (gates, one stream, a graph) travel in the bucket's
:class:`~aiosync.planes.base.BucketContext`, made by the caller for that bucket and passed
to the planes' hooks and to :meth:`DeviceCopies.queue`; the next batch queued with it
takes them, and a hint no batch took goes with the context.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan, is_plain
from aiosync.planes.base import BucketContext
from aiosync.planes.base import CounterGate as CounterGate  # defined beside the context
from aiosync.planes.base import Gate as Gate
from aiosync.planes.cuda_counters import wait_value
from aiosync.planes.cuda_graphs import CopyGraph, CopyJob
from aiosync.planes.cuda_runtime import memcpy_async

WIDTH = 2
"""Streams a batch is spread over: the caller's and one side stream."""

SPREAD_MIN_BYTES = 8 << 20
"""Smaller batches go on the caller's stream alone: a fork and a join cost more than the
tails they would hide."""

GRAPH_MIN_JOBS = 16
"""Copies a batch needs to be kept as a graph once it recurs (fewer are queued one by one)."""
GRAPH_LANES = 4
"""Independent chains of a batch's graph (one where the batch is to take one stream)."""
GRAPHS_KEPT = 512
"""Graphs one :class:`DeviceCopies` keeps (the least recently launched go first): more than
a version's direct buckets for any model of today (64 regions a bucket)."""
SEEN_KEPT = 1024
"""Batches seen once that one :class:`DeviceCopies` remembers, to make a graph if they recur."""


log = logging.getLogger(__name__)


def wait_gate(stream: torch.cuda.Stream, gate: Gate, context: BucketContext | None = None) -> None:
    """Make ``stream`` wait on ``gate`` (another process's), and note it in ``context``.

    The next :meth:`DeviceCopies.queue` with that context makes its side streams wait on
    every gate so noted since the last batch, before its fork (see the module's docstring).
    """
    _wait(stream, gate)
    if context is not None:
        context.gates.append(gate)


_NO_HINTS: tuple[list[Gate], bool, bool] = ([], False, False)


def _wait(stream: torch.cuda.Stream, gate: Gate) -> None:
    if isinstance(gate, CounterGate):
        wait_value(stream.cuda_stream, gate.address, gate.value)
    else:
        stream.wait_event(gate)


def deal(sizes: Sequence[int], width: int) -> list[int]:
    """The stream (0 to ``width - 1``) of each copy: each to the least loaded so far.

    In the given order, so the first copies of a bucket start first on every stream.
    """
    loads = [0] * width
    lanes = []
    for size in sizes:
        lane = loads.index(min(loads))
        lanes.append(lane)
        loads[lane] += size
    return lanes


class DeviceCopies:
    """Queues batches of device-to-device copies on one GPU, spread over :data:`WIDTH` streams.

    One per owner (an engine's copy programs, a sender plane); the side stream and events
    are made on first use and kept, as are the graphs of recurring batches that asked for
    one (``BucketContext.graph``; none if ``graphs`` is False) until :meth:`prune` finds them
    unused or :meth:`close`. Safe to call from any thread; no host wait.
    """

    def __init__(self, device: int, width: int = WIDTH, *, graphs: bool = True) -> None:
        self.device = device
        self.width = width
        self.graphs = graphs
        self._lock = threading.Lock()
        self._sides: list[torch.cuda.Stream] = []
        self._fork: torch.cuda.Event | None = None
        self._joins: list[torch.cuda.Event] = []
        self._kept: OrderedDict[tuple[object, ...], CopyGraph] = OrderedDict()
        self._seen: OrderedDict[tuple[object, ...], None] = OrderedDict()
        self._asked: set[tuple[object, ...]] = set()  # batches asked for since prune()
        self.batches: Counter[str] = Counter()
        """How each batch went: ``graph`` (launched), ``gated`` (a graph asked for while a
        gate had not fired: copy by copy), ``unseen`` (asked for, but no graph made yet or
        too few copies for one), ``copies`` (no graph asked for, or graphs off)."""

    def queue(
        self,
        jobs: Sequence[CopyJob],
        stream: torch.cuda.Stream,
        context: BucketContext | None = None,
    ) -> None:
        """Queue ``jobs`` so that, to later work on ``stream``, they ran on ``stream``.

        ``stream`` is on this object's device, as is every address (or mapped into it).
        ``context``: the bucket's hints, which this batch takes (gates, one stream, graph).
        """
        gates, one_stream, hinted = context.take() if context is not None else _NO_HINTS
        if not jobs:
            return
        with self._lock, torch.cuda.device(self.device):
            lanes = 1 if one_stream or self.width < 2 else GRAPH_LANES
            may = hinted and self._may_graph(gates)
            graph = self._graph(jobs, lanes) if may else None
            if graph is not None:
                self.batches["graph"] += 1
                graph.launch(stream)
                return
            self.batches["unseen" if may else "gated" if hinted and self.graphs else "copies"] += 1
            sizes = [nbytes for _, _, nbytes in jobs]
            if one_stream or self.width < 2 or len(jobs) < 2 or sum(sizes) < SPREAD_MIN_BYTES:
                handle = stream.cuda_stream
                for dst, src, nbytes in jobs:
                    memcpy_async(dst, src, nbytes, handle)
                return
            fork, sides, joins = self._parts()
            fork.record(stream)
            for side in sides:
                for gate in gates:
                    _wait(side, gate)
                side.wait_event(fork)
            handles = [stream.cuda_stream] + [side.cuda_stream for side in sides]
            try:
                for (dst, src, nbytes), lane in zip(jobs, deal(sizes, self.width), strict=True):
                    memcpy_async(dst, src, nbytes, handles[lane])
            finally:  # what was queued on a side stream stays before the caller's later work
                for side, join in zip(sides, joins, strict=True):
                    join.record(side)
                    stream.wait_event(join)

    def _may_graph(self, gates: list[Gate]) -> bool:
        """Whether this batch may run as a graph: no other process's event is pending.

        A graph's chains wait on the caller's stream, which is this process's: while that
        stream waits on another process's work on the same GPU, they keep this process's
        turn on it and the GPU idles (packed buckets, trainer and engine on one H200: 32 ms
        a version instead of 20). So a batch whose gates have not all fired yet is queued
        copy by copy, its side stream waiting on those gates itself.
        """
        return self.graphs and all(gate.query() for gate in gates)  # type: ignore[no-untyped-call]

    def _graph(self, jobs: Sequence[CopyJob], lanes: int) -> CopyGraph | None:
        """The kept graph of ``jobs``; made now if they were seen before; else None."""
        if len(jobs) < GRAPH_MIN_JOBS:
            return None
        key = (lanes, *jobs)
        self._asked.add(key)
        graph = self._kept.get(key)
        if graph is not None:
            self._kept.move_to_end(key)
            return graph
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > SEEN_KEPT:
                self._seen.popitem(last=False)
            return None
        del self._seen[key]
        try:
            chains = deal([nbytes for _, _, nbytes in jobs], lanes)
            graph = self._kept[key] = CopyGraph(jobs, self.device, chains)
        except (AiosyncError, AttributeError) as exc:  # a runtime without these graph calls
            log.warning("copies stay one by one on cuda:%d: no CUDA graph (%s)", self.device, exc)
            self.graphs = False
            return None
        if len(self._kept) > GRAPHS_KEPT:
            self._kept.popitem(last=False)[1].close()  # a launch in flight still completes
        return graph

    def prune(self) -> None:
        """Let go of the graphs and batches not asked for since the last prune.

        An engine prunes once a version: what that version did not read (a closed
        session's regions, a layout gone) is not kept.
        """
        with self._lock:
            for key in [key for key in self._kept if key not in self._asked]:
                self._kept.pop(key).close()
            for key in [key for key in self._seen if key not in self._asked]:
                del self._seen[key]
            self._asked.clear()

    def close(self) -> None:
        """Let go of the kept graphs (launches in flight still complete); idempotent."""
        with self._lock:
            for graph in self._kept.values():
                graph.close()
            self._kept.clear()
            self._seen.clear()
            self._asked.clear()

    def _parts(self) -> tuple[torch.cuda.Event, list[torch.cuda.Stream], list[torch.cuda.Event]]:
        if self._fork is None:
            self._sides = [
                torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                for _ in range(self.width - 1)
            ]
            self._joins = [torch.cuda.Event() for _ in self._sides]  # type: ignore[no-untyped-call]
            self._fork = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return self._fork, self._sides, self._joins


def plain_jobs(buffer: torch.Tensor, plan: BucketPlan) -> tuple[list[CopyJob], BucketPlan]:
    """Split packing a bucket into ``buffer`` (flat ``uint8``): copies by address, the rest.

    Plain tensors on the buffer's device become :data:`CopyJob`; any other (another device,
    the CPU, not contiguous) stays in the returned plan, for
    :func:`~aiosync.core.layout.pack_bucket`. A plan larger than the buffer is a
    ``ValueError``, before anything is copied.
    """
    if plan.used > buffer.numel():
        raise ValueError(f"bucket needs {plan.used} bytes but the buffer holds {buffer.numel()}")
    base, device = buffer.data_ptr(), buffer.device.index if buffer.is_cuda else None
    jobs: list[CopyJob] = []
    rest = BucketPlan(used=plan.used)
    for source, spec in zip(plan.tensors, plan.specs, strict=True):
        if (
            source.is_cuda
            and source.device.index == device
            and is_plain(source)
            and spec.start + spec.nbytes <= source.nbytes
            and spec.offset + spec.nbytes <= plan.used
        ):
            if spec.nbytes:
                jobs.append((base + spec.offset, source.data_ptr() + spec.start, spec.nbytes))
        else:
            rest.tensors.append(source)
            rest.specs.append(spec)
    return jobs, rest
