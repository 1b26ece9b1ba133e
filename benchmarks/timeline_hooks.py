"""Where one version's time goes: host timestamps and GPU spans in both processes.

A profiling aid for :mod:`benchmarks.cuda_timeline`, never imported by the library. A
:class:`Recorder` keeps host marks (``time.monotonic_ns``, one clock for every process of
the machine) and, on CUDA, timing events around each bucket's pack and apply, placed in
host time through a reference event recorded while the device was idle.
:func:`trainer_hooks` and :func:`engine_hooks` wrap the pipeline's functions in place (this
process only); :mod:`benchmarks.timeline_view` merges both sides' records into one row
per bucket and prints them. The switches that turn steps back or off their threads are in
:mod:`benchmarks.timeline_switches`.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Mark = tuple[int, str, int, int | None]  # host ns, kind, version, seq


class Recorder:
    """Host marks and GPU spans of one process, while :attr:`enabled`."""

    def __init__(self, cuda: bool, device: torch.device | str | None = None) -> None:
        self.cuda = cuda
        self.device = torch.device(device) if device is not None else None
        """The GPU whose streams the spans are on (default: the current one); a worker
        thread's current device may be another."""
        self.enabled = False
        self.version = -1
        self.seq: int | None = None
        self.packs = 0
        self.sends = 0  # a trainer's sends so far (a version is known only once read)
        self.marks: list[Mark] = []
        self._spans: list[tuple[str, int, int | None, Any, Any]] = []
        self._reference: tuple[Any, int] | None = None

    def start(self) -> None:
        """Forget what was recorded, take a reference (the device idle) and record."""
        self.marks.clear()
        self._spans.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            before = time.monotonic_ns()
            event.record(torch.cuda.current_stream(self.device))  # type: ignore[no-untyped-call]
            event.synchronize()  # type: ignore[no-untyped-call]
            self._reference = (event, (before + time.monotonic_ns()) // 2)
        self.enabled = True

    def mark(self, kind: str, seq: int | None = None, version: int | None = None) -> None:
        """A host mark now."""
        if self.enabled:
            ver = self.version if version is None else version
            self.marks.append((time.monotonic_ns(), kind, ver, seq))

    @contextmanager
    def span(self, kind: str, seq: int | None) -> Iterator[None]:
        """A GPU span on the current stream around the block (host marks on the CPU)."""
        if not self.enabled:
            yield
            return
        self.mark(kind + "_host0", seq)
        if not self.cuda:
            yield
            self.mark(kind + "_host1", seq)
            return
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        begin.record(torch.cuda.current_stream(self.device))  # type: ignore[no-untyped-call]
        yield
        end.record(torch.cuda.current_stream(self.device))  # type: ignore[no-untyped-call]
        self.mark(kind + "_host1", seq)
        self._spans.append((kind, self.version, seq, begin, end))

    def add_span(self, kind: str, seq: int | None, begin: Any, end: Any) -> None:
        """A GPU span between two timing events the caller recorded."""
        if self.enabled and self.cuda:
            self._spans.append((kind, self.version, seq, begin, end))

    def dump(self) -> list[Mark]:
        """Stop; every mark, GPU spans as ``<kind>_gpu0`` / ``<kind>_gpu1`` marks."""
        self.enabled = False
        out = list(self.marks)
        if self.cuda and self._reference is not None:
            torch.cuda.synchronize(self.device)
            ref, ref_ns = self._reference
            for kind, version, seq, begin, end in self._spans:
                for edge, event in (("0", begin), ("1", end)):
                    when = ref_ns + int(ref.elapsed_time(event) * 1e6)
                    out.append((when, f"{kind}_gpu{edge}", version, seq))
        return sorted(out)


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def mark_phase(rec: Recorder, owner: Any, name: str, kind: str) -> None:
    """Wrap ``owner.name`` (a function or a coroutine function) in marks ``kind0``/``kind1``."""
    orig = getattr(owner, name)
    if inspect.iscoroutinefunction(orig):

        async def awaited(*args: Any, **kwargs: Any) -> Any:
            rec.mark(kind + "0")
            try:
                return await orig(*args, **kwargs)
            finally:
                rec.mark(kind + "1")

        setattr(owner, name, awaited)
        return

    def called(*args: Any, **kwargs: Any) -> Any:
        rec.mark(kind + "0")
        try:
            return orig(*args, **kwargs)
        finally:
            rec.mark(kind + "1")

    setattr(owner, name, called)


def trainer_hooks(rec: Recorder) -> None:
    """Mark the trainer's steps: send, read, begin, each bucket's pack/send/ack, commit."""
    from aiosync.pipeline import ahead, fanout, links, stream
    from aiosync.planes import cuda, shm
    from aiosync.trainer import direct, sender

    def send(orig: Any) -> Any:
        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            first = len(rec.marks)
            rec.packs = 0
            rec.sends += 1
            rec.mark("send0")
            try:
                return await orig(self, *args, **kwargs)
            finally:
                rec.mark("send1")
                # the version is known once the stream starts: tag this send's marks with it
                rec.marks[first:] = [(t, k, rec.version, s) for t, k, _, s in rec.marks[first:]]

        return wrapped

    def stream_init(orig: Any) -> Any:
        def wrapped(self: Any, **kwargs: Any) -> None:
            orig(self, **kwargs)
            rec.version = self.version

        return wrapped

    def read_source(orig: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rec.mark("read0")
            try:
                return orig(*args, **kwargs)
            finally:
                rec.mark("read1")

        return wrapped

    def pack_bucket(orig: Any) -> Any:
        def wrapped(buffer: Any, plan: Any, *args: Any) -> None:
            rec.packs += 1
            with rec.span("pack", rec.packs):
                orig(buffer, plan, *args)

        return wrapped

    def pack_next(orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, plans: Any, index: int) -> Any:
            rec.mark("packcall0", rec.packs + 1)
            out = orig(self, plans, index)
            rec.mark("packcall1", None if out is None else out.seq)
            return out

        return wrapped

    def pack_ahead(orig: Any) -> Any:  # bucket 1, packed in the thread that read
        @functools.wraps(orig)
        def wrapped(*args: Any) -> Any:
            rec.mark("packcall0", 1)
            orig(*args)
            rec.mark("packcall1", 1)

        return wrapped

    def send_one(orig: Any) -> Any:
        async def wrapped(self: Any, link: Any, packed: Any, inflight: Any) -> None:
            await orig(self, link, packed, inflight)
            rec.mark("sent", packed.seq)

        return wrapped

    def begin_early(orig: Any) -> Any:  # the begin sent before the read
        async def wrapped(*args: Any) -> Any:
            early = await orig(*args)
            if early is not None:
                rec.mark("sent", 0)
            return early

        return wrapped

    def recv_ack(orig: Any) -> Any:
        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            ack = await orig(self, *args, **kwargs)
            rec.mark("ack", ack.seq)
            return ack

        return wrapped

    _wrap(sender.WeightSender, "send", send)
    _wrap(sender, "read_source", read_source)
    _wrap(direct.DirectReader, "read", read_source)  # direct mode reads through this
    _wrap(direct.DirectReader, "read_kept", read_source)  # or this, on the loop
    _wrap(cuda, "_pack", pack_bucket)
    _wrap(shm, "pack_bucket", pack_bucket)
    _wrap(fanout.BucketFanout, "_pack_next", pack_next)
    _wrap(ahead, "pack_plan", pack_ahead)
    _wrap(fanout.BucketFanout, "_send_one", send_one)
    _wrap(links.EngineLink, "recv_ack", recv_ack)
    _wrap(sender, "begin_early", begin_early)
    _wrap(stream.StreamRun, "__init__", stream_init)
    mark_phase(rec, stream.StreamRun, "run", "stream")
    mark_phase(rec, fanout.BucketFanout, "run", "fanout")
    mark_phase(rec, links.EngineLink, "send", "linksend")
    mark_phase(rec, stream.StreamRun, "_complete", "complete")
    if hasattr(stream.StreamRun, "_complete_and_commit"):  # commit sent with the complete
        mark_phase(rec, stream.StreamRun, "_complete_and_commit", "complete")
    mark_phase(rec, stream.StreamRun, "_commit", "commit")
    mark_phase(rec, fanout.BucketFanout, "_encoded", "encoded")
    mark_phase(rec, fanout.BucketFanout, "_ack_loop", "ackloop")
    mark_phase(rec, links.EngineLink, "_recv", "linkrecv")


def engine_hooks(rec: Recorder, sink: Any) -> None:
    """Mark the engine's steps: each message decoded, apply (host and GPU), each reply."""
    from aiosync.core import wire
    from aiosync.engine import receiver

    def decode(orig: Any) -> Any:
        def wrapped(self: Any, payload: bytes) -> Any:
            when = time.monotonic_ns()
            message = orig(self, payload)
            if rec.enabled:
                version = getattr(message, "version", None)
                if type(message).__name__ == "Begin" and version is not None:
                    rec.version = version
                kind = "recv_" + type(message).__name__.lower()
                rec.marks.append((when, kind, rec.version, getattr(message, "seq", None)))
                if getattr(message, "first", None) is not None:  # bucket 1 in the begin
                    rec.marks.append((when, "recv_bucket", rec.version, 1))
            return message

        return wrapped

    def apply(orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, plane: Any, action: Any, **kwargs: Any) -> None:
            rec.seq = action.seq
            rec.mark("apply0", action.seq)
            orig(self, plane, action, **kwargs)
            rec.mark("apply1", action.seq)

        return wrapped

    def reply(orig: Any) -> Any:
        async def wrapped(self: Any, peer: Any, message: Any) -> None:
            await orig(self, peer, message)
            rec.mark("reply", getattr(message, "seq", None))

        return wrapped

    bucket_apply = sink.apply_bucket

    def apply_bucket(bucket: torch.Tensor, specs: list[Any]) -> None:
        with rec.span("copy", rec.seq):
            bucket_apply(bucket, specs)

    parts_apply = sink.apply_parts

    def apply_parts(parts: list[Any]) -> None:  # a direct bucket of several regions
        with rec.span("copy", rec.seq):
            parts_apply(parts)

    sink_commit = sink.commit

    def commit(version: int) -> None:
        rec.mark("sinkcommit0")
        sink_commit(version)
        rec.mark("sinkcommit1")

    _wrap(wire.ManifestMemo, "decode", decode)
    mark_phase(rec, receiver.WeightReceiver, "_decide", "decide")
    mark_phase(rec, receiver, "view_parts", "view")
    mark_phase(rec, receiver.WeightReceiver, "_do", "do")
    _wrap(receiver.WeightReceiver, "_apply", apply)
    _wrap(receiver.WeightReceiver, "_reply", reply)
    sink.apply_bucket = apply_bucket
    sink.apply_parts = apply_parts
    sink.commit = commit
