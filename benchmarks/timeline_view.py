"""One version's timeline from both processes' marks (:mod:`benchmarks.timeline_hooks`).

:func:`timeline` merges the trainer's and the engine's records into one row per bucket (ms
from the trainer's send), the version's phases and every mark of its first
:data:`EARLY_MS`; :func:`render` prints them as a table.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.timeline_hooks import Mark

EARLY_MS = 3.0
"""A timeline lists every mark of this many first ms of the version (where the start goes)."""

TAIL_MS = 1.5
"""... and of this many last ms, up to the send's return (where the end goes)."""

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

    def between(low: float, high: float) -> list[tuple[str, float, int | None]]:
        """Both sides' marks of the version from ``low`` to ``high`` (ns), in order."""
        found = [
            (side + " " + kind, round((when - t0) / 1e6, 3), seq)
            for side, records in (("T", trainer), ("E", engine))
            for when, kind, ver, seq in records
            if ver == version and low <= when <= high
        ]
        return sorted(found, key=lambda mark: mark[1])

    view["start"] = between(t0, t0 + EARLY_MS * 1e6)  # where the start goes
    end = marks.get(("T send1", None))
    if end is not None:  # and the last TAIL_MS, up to the send's return (where the end goes)
        view["end"] = between(end - TAIL_MS * 1e6, end)
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
    for part in ("start", "end"):
        if view.get(part):
            marks = (f"{k}{'' if q is None else f'[{q}]'} {t}" for k, t, q in view[part])
            lines.append(f"{part}: " + ", ".join(marks))
    if "summary" in view:
        lines.append("summary: " + ", ".join(f"{k} {v}" for k, v in view["summary"].items()))
    return "\n".join(lines)
