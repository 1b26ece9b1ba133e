"""Where a collective version's time goes: marks of both processes of :mod:`.collective`.

A profiling aid, never imported by the library. On top of
:func:`~benchmarks.timeline_hooks.trainer_hooks` and
:func:`~benchmarks.timeline_hooks.engine_hooks` it marks, on each side, the k-th
broadcast of a version: when it was queued (host) and when it ran (a GPU
span on the stream it was queued on), the engine's ``view`` (posting the receive) and the
version's one host wait (``settle``, ``drain``). :func:`collective_timeline` gives one row
per bucket, in ms from the trainer's send.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from benchmarks import timeline_hooks, timeline_view
from benchmarks.timeline_hooks import Mark, Recorder, mark_phase

COLUMNS = [
    ("T packcall0", "pack call"),
    ("T pack_gpu0", "pack gpu0"),
    ("T pack_gpu1", "pack gpu1"),
    ("T bcast_host0", "T queue0"),
    ("T bcast_gpu0", "T bc gpu0"),
    ("T sent", "sent"),
    ("E recv_bucket", "eng recv"),
    ("E view0", "view0"),
    ("E bcast_host1", "E queued"),
    ("E bcast_gpu0", "E bc gpu0"),
    ("E bcast_gpu1", "E bc gpu1"),
    ("E copy_gpu1", "copy gpu1"),
    ("E reply", "eng ack"),
    ("T ack", "ack"),
]
PHASES = [
    ("T", "read0"),
    ("T", "read1"),
    ("T", "drain0"),
    ("T", "drain1"),
    ("T", "complete0"),
    ("T", "complete1"),
    ("T", "send1"),
    ("E", "recv_begin"),
    ("E", "recv_complete"),
    ("E", "settle0"),
    ("E", "settle1"),
    ("E", "sinkcommit0"),
    ("E", "sinkcommit1"),
    ("E", "recv_commit"),
]


def _broadcasts(rec: Recorder) -> None:
    """Mark each broadcast queued by this process: queued (host) and run (GPU span).

    The span starts on the issuing stream and ends on a stream of its own made to wait for
    the collectives (they run on NCCL's stream), so it covers the broadcast itself.
    """
    import torch

    from aiosync.collectives import ops

    counts: dict[tuple[int, int], int] = {}
    ends: dict[Any, Any] = {}
    queue = ops.queue_broadcasts

    @functools.wraps(queue)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        key = (rec.version, rec.sends)  # a trainer queues bucket 1 before its version is known
        seq = counts[key] = counts.get(key, 0) + 1
        if not rec.enabled or not rec.cuda:
            rec.mark("bcast_host0", seq)
            works = queue(*args, **kwargs)
            rec.mark("bcast_host1", seq)
            return works
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        rec.mark("bcast_host0", seq)
        device = rec.device or torch.device("cuda", torch.cuda.current_device())
        begin.record(torch.cuda.current_stream(device))  # type: ignore[no-untyped-call]
        works = queue(*args, **kwargs)
        rec.mark("bcast_host1", seq)
        side = ends.get(device)
        if side is None:
            side = ends[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            for work in works:
                work.wait()
            end.record(side)  # type: ignore[no-untyped-call]
        rec.add_span("bcast", seq, begin, end)
        return works

    ops.queue_broadcasts = wrapped  # type: ignore[assignment]


def trainer_collective_hooks(rec: Recorder) -> None:
    """The trainer's marks (see the module's docstring); this process only."""
    from aiosync.planes import collective

    timeline_hooks.trainer_hooks(rec)
    original = getattr(collective, "pack_bucket")  # noqa: B009 (patched below)

    def pack_bucket(buffer: Any, plan: Any, *args: Any) -> None:
        rec.packs += 1
        with rec.span("pack", rec.packs):
            original(buffer, plan, *args)

    setattr(collective, "pack_bucket", pack_bucket)  # noqa: B010
    _broadcasts(rec)
    mark_phase(rec, collective.CollectiveSenderPlane, "drain", "drain")


def engine_collective_hooks(rec: Recorder, sink: Any) -> None:
    """The engine's marks (see the module's docstring); this process only."""
    from aiosync.planes import collective_receiver

    timeline_hooks.engine_hooks(rec, sink)
    plane = collective_receiver.CollectiveReceiverPlane
    view = plane.view

    def marked_view(self: Any, index: int, used: int, context: Any = None) -> Any:
        rec.mark("view0", rec.seq)
        return view(self, index, used, context)

    plane.view = marked_view  # type: ignore[method-assign]
    _broadcasts(rec)
    mark_phase(rec, plane, "settle", "settle")


def collective_timeline(
    trainer: Sequence[Mark], engine: Sequence[Mark], version: int
) -> dict[str, Any]:
    """One version's rows (ms from the trainer's send) and its phases."""
    return timeline_view.timeline(trainer, engine, version, columns=COLUMNS, phases=PHASES)
