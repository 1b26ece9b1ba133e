"""Where one version's time goes: host timestamps and GPU spans in both processes.

A profiling aid for :mod:`aiosync.bench.cuda_timeline`, never imported by the library. A
:class:`Recorder` keeps host marks (``time.monotonic_ns``, one clock for every process of
the machine) and, on CUDA, timing events around each bucket's pack and apply, placed in
host time through a reference event recorded while the device was idle.
:func:`trainer_hooks` and :func:`engine_hooks` wrap the pipeline's functions in place (this
process only); :func:`timeline` merges both sides' records into one row per bucket, and
:func:`render` prints them. The switches that turn steps back or off their threads are in
:mod:`aiosync.bench.timeline_switches`.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
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


def trainer_hooks(rec: Recorder) -> None:
    """Mark the trainer's steps: send, read, begin, each bucket's pack/send/ack, commit."""
    from aiosync.pipeline import ahead, fanout, links, stream
    from aiosync.planes import cuda_legacy, shm
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

    def recv_ack(orig: Any) -> Any:
        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            ack = await orig(self, *args, **kwargs)
            rec.mark("ack", ack.seq)
            return ack

        return wrapped

    def phase(kind: str) -> Callable[[Any], Any]:
        def make(orig: Any) -> Any:
            async def wrapped(self: Any, *args: Any) -> Any:
                rec.mark(kind + "0")
                try:
                    return await orig(self, *args)
                finally:
                    rec.mark(kind + "1")

            return wrapped

        return make

    _wrap(sender.WeightSender, "send", send)
    _wrap(sender, "read_source", read_source)
    _wrap(direct.DirectReader, "read", read_source)  # direct mode reads through this
    _wrap(cuda_legacy, "_pack", pack_bucket)
    _wrap(shm, "pack_bucket", pack_bucket)
    _wrap(fanout.BucketFanout, "_pack_next", pack_next)
    _wrap(ahead, "pack_plan", pack_ahead)
    _wrap(fanout.BucketFanout, "_send_one", send_one)
    _wrap(links.EngineLink, "recv_ack", recv_ack)
    _wrap(stream.StreamRun, "__init__", stream_init)
    _wrap(stream.StreamRun, "run", phase("stream"))
    _wrap(fanout.BucketFanout, "run", phase("fanout"))
    _wrap(links.EngineLink, "send", phase("linksend"))
    _wrap(stream.StreamRun, "_complete", phase("complete"))
    if hasattr(stream.StreamRun, "_complete_and_commit"):  # commit sent with the complete
        _wrap(stream.StreamRun, "_complete_and_commit", phase("complete"))
    _wrap(stream.StreamRun, "_commit", phase("commit"))


def engine_hooks(rec: Recorder, sink: Any) -> None:
    """Mark the engine's steps: each message decoded, apply (host and GPU), each reply."""
    from aiosync.engine import receiver

    def decode(orig: Any) -> Any:
        def wrapped(payload: bytes) -> Any:
            when = time.monotonic_ns()
            message = orig(payload)
            if rec.enabled:
                version = getattr(message, "version", None)
                if type(message).__name__ == "Begin" and version is not None:
                    rec.version = version
                kind = "recv_" + type(message).__name__.lower()
                rec.marks.append((when, kind, rec.version, getattr(message, "seq", None)))
            return message

        return wrapped

    def apply(orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, plane: Any, action: Any) -> None:
            rec.seq = action.seq
            rec.mark("apply0", action.seq)
            orig(self, plane, action)
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

    _wrap(receiver, "decode", decode)
    _wrap(receiver.WeightReceiver, "_apply", apply)
    _wrap(receiver.WeightReceiver, "_reply", reply)
    sink.apply_bucket = apply_bucket
    sink.apply_parts = apply_parts
    sink.commit = commit


EARLY_MS = 3.0
"""A timeline lists every mark of this many first ms of the version (where the start goes)."""

PHASES = [
    ("T", "read0"),
    ("T", "read1"),
    ("T", "complete0"),
    ("T", "complete1"),
    ("T", "commit0"),
    ("T", "commit1"),
    ("T", "send1"),
    ("E", "recv_begin"),
    ("E", "recv_complete"),
    ("E", "sinkcommit0"),
    ("E", "sinkcommit1"),
    ("E", "recv_commit"),
]

BUCKET_COLUMNS = [
    ("T packcall0", "pack call"),
    ("T pack_host1", "pack host1"),
    ("T pack_gpu0", "pack gpu0"),
    ("T pack_gpu1", "pack gpu1"),
    ("T sent", "sent"),
    ("E recv_bucket", "eng recv"),
    ("E apply0", "apply0"),
    ("E copy_host1", "copy host1"),
    ("E copy_gpu0", "copy gpu0"),
    ("E copy_gpu1", "copy gpu1"),
    ("E reply", "eng ack"),
    ("T ack", "ack"),
]


def timeline(
    trainer: Sequence[Mark],
    engine: Sequence[Mark],
    version: int,
    columns: Sequence[tuple[str, str]] = (),
    phases: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """One version's rows (ms from the trainer's send), phases and a summary of gaps.

    ``columns`` and ``phases`` replace :data:`BUCKET_COLUMNS` and the phases of a CUDA
    plane's timeline (then there is no summary).
    """
    marks: dict[tuple[str, int | None], int] = {}
    for side, records in (("T", trainer), ("E", engine)):
        for when, kind, ver, seq in records:
            if ver == version:
                marks.setdefault((f"{side} {kind}", seq), when)
                marks.setdefault((f"{side} {kind}", None), when)  # a phase: its first mark
    t0 = marks.get(("T send0", None))
    if t0 is None:
        return {"error": f"no marks for version {version}"}
    seqs = sorted({seq for (kind, seq) in marks if kind == "T sent" and seq is not None})

    def at(kind: str, seq: int | None = None) -> float | None:
        value = marks.get((kind, seq))
        return None if value is None else round((value - t0) / 1e6, 3)

    cols = list(columns) or BUCKET_COLUMNS
    rows = [[seq] + [at(kind, seq) for kind, _ in cols] for seq in seqs]
    wanted = list(phases) or PHASES
    out = {kind: at(f"{side} {kind}") for side, kind in wanted}
    view: dict[str, Any] = {"version": version, "rows": rows, "phases": out}
    view["head"] = ["seq"] + [name for _, name in cols]
    view["start"] = [  # every mark of the version's first EARLY_MS, in order
        (side + " " + kind, round((when - t0) / 1e6, 3), seq)
        for side, records in (("T", trainer), ("E", engine))
        for when, kind, ver, seq in records
        if ver == version and 0 <= when - t0 <= EARLY_MS * 1e6
    ]
    view["start"].sort(key=lambda mark: mark[1])
    if not columns:
        view["summary"] = _summary(rows)
    return view


def _summary(rows: list[list[Any]]) -> dict[str, float]:
    """Medians over buckets, and the GPU's busy time against the span it covers."""
    names = [name for _, name in BUCKET_COLUMNS]
    col = {name: i + 1 for i, name in enumerate(names)}

    def med(a: str, b: str) -> float:
        values = [r[col[b]] - r[col[a]] for r in rows if r[col[a]] is not None and r[col[b]]]
        return round(statistics.median(values), 3) if values else float("nan")

    spans = [
        (r[col[a]], r[col[b]])
        for r in rows
        for a, b in (("pack gpu0", "pack gpu1"), ("copy gpu0", "copy gpu1"))
        if r[col[a]] is not None and r[col[b]] is not None
    ]
    out = {
        "pack_call_to_sent_ms": med("pack call", "sent"),
        "pack_launch_ms": med("pack call", "pack host1"),
        "copy_launch_ms": med("apply0", "copy host1"),
        "sent_to_engine_recv_ms": med("sent", "eng recv"),
        "engine_recv_to_apply_ms": med("eng recv", "apply0"),
        "apply0_to_engine_ack_ms": med("apply0", "eng ack"),
        "engine_ack_to_ack_ms": med("eng ack", "ack"),
        "pack_gpu_ms": med("pack gpu0", "pack gpu1"),
        "copy_gpu_ms": med("copy gpu0", "copy gpu1"),
        "pack_end_to_copy_start_ms": med("pack gpu1", "copy gpu0"),
    }
    if spans:
        spans.sort()
        busy, end = 0.0, spans[0][0]
        for a, b in spans:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        out["gpu_busy_ms"] = round(busy, 3)
        out["gpu_first_to_last_ms"] = round(end - spans[0][0], 3)
    return out


def render(view: dict[str, Any]) -> str:
    """The timeline as a fixed-width table (ms from the trainer's send)."""
    if "error" in view:
        return str(view["error"])
    head = view.get("head") or ["seq"] + [name for _, name in BUCKET_COLUMNS]
    lines = [" ".join(f"{h:>9}" for h in head)]
    for row in view["rows"]:
        lines.append(" ".join(f"{'-' if v is None else v:>9}" for v in row))
    lines.append("phases: " + ", ".join(f"{k} {v}" for k, v in view["phases"].items()))
    if view.get("start"):
        marks = (f"{k}{'' if q is None else f'[{q}]'} {t}" for k, t, q in view["start"])
        lines.append("start: " + ", ".join(marks))
    if "summary" in view:
        lines.append("summary: " + ", ".join(f"{k} {v}" for k, v in view["summary"].items()))
    return "\n".join(lines)
