"""The per-bucket timeline tool (``python -m benchmarks.cuda_timeline``), run on the CPU.

On the CPU it streams a scaled-down Llama layout over shared memory with the same hooks it
uses on a GPU: every variant commits bit-exact, and the traced versions have one row per
bucket with each host step in order. The merge of both processes' marks is checked alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.timeline_view import BUCKET_COLUMNS, render, timeline

ROOT = Path(__file__).resolve().parents[2]


def test_the_tool_traces_every_bucket_of_a_cpu_stream(tmp_path: Path) -> None:
    from aiosync.runtime import child_env

    argv = [sys.executable, "-m", "benchmarks.cuda_timeline", "--device", "cpu"]
    argv += ["--hidden", "64", "--variants", "2x1,2x1io,2x1d,2x1f"]
    argv += ["--repeats", "1", "--traced", "1"]
    argv += ["--probe", "", "--out", str(tmp_path)]
    done = subprocess.run(
        argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240, check=True
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bit_exact"] is True
    assert out["tensors"] == 291
    assert set(out) >= {"2x1", "2x1io", "2x1d", "2x1f"}  # d, f: direct mode
    (view,) = out["traced"]
    rows = view["rows"]
    assert [row[0] for row in rows] == list(range(len(rows)))  # the begin, then each bucket
    names = [name for _, name in BUCKET_COLUMNS]
    for row in rows[1:]:
        step = dict(zip(names, row[1:], strict=True))
        assert step["pack call"] <= step["sent"] <= step["ack"]
        assert step["eng recv"] <= step["apply0"] <= step["eng ack"]
    phases = view["phases"]  # a commit sent with the complete has no phase of its own
    assert (phases["commit1"] or phases["complete1"]) <= phases["send1"]
    marks = json.loads((tmp_path / "timeline_marks.json").read_text())
    assert marks["trainer"]
    assert marks["engine"]


def test_marks_of_both_sides_merge_into_rows_from_the_send() -> None:
    ms = 1_000_000
    trainer = [
        (100 * ms, "send0", 3, None),
        (101 * ms, "packcall0", 3, 1),
        (102 * ms, "pack_gpu0", 3, 1),
        (103 * ms, "pack_gpu1", 3, 1),
        (104 * ms, "sent", 3, 1),
        (109 * ms, "ack", 3, 1),
        (110 * ms, "send1", 3, None),
        (50 * ms, "send0", 2, None),  # another version: left out
    ]
    engine = [
        (105 * ms, "recv_bucket", 3, 1),
        (105 * ms, "apply0", 3, 1),
        (106 * ms, "copy_gpu0", 3, 1),
        (107 * ms, "copy_gpu1", 3, 1),
        (108 * ms, "reply", 3, 1),
    ]
    view = timeline(trainer, engine, 3)
    (row,) = view["rows"]
    step = dict(zip([name for _, name in BUCKET_COLUMNS], row[1:], strict=True))
    assert step["pack call"] == 1.0
    assert step["copy gpu1"] == 7.0
    assert step["pack host1"] is None  # not marked: shown as missing
    assert view["phases"]["send1"] == 10.0
    assert view["summary"]["gpu_busy_ms"] == 2.0
    assert view["summary"]["pack_end_to_copy_start_ms"] == 3.0
    assert "summary" in render(view)
    assert "error" in timeline(trainer, engine, 7)
