"""One CPU bucket's trip, traced in both processes (``python -m benchmarks.trip``), can only
cross fewer files (issue 27's shape figure: at most 12 is the goal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aiosync import ModuleSink, WeightSender
from aiosync.runtime import child_env
from benchmarks.trip import ROOT, render

TRIP_TODAY = 38
"""Files of ``aiosync/`` one CPU bucket's trip crosses today, both processes together (the
union), from ``WeightSender.send`` to the sink's copy: only to go down."""


def relative(code_file: str) -> str:
    return str(Path(code_file).resolve().relative_to(ROOT))


def test_a_cpu_buckets_trip_crosses_no_more_files_than_today() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.trip", "--json"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trip = json.loads(done.stdout)
    text = render(trip)
    print(text)
    trainer = [entry["file"] for entry in trip["trainer"]["files"]]
    engine = [entry["file"] for entry in trip["engine"]["files"]]
    # the markers were seen where they are: the trace is of the trip, not of nothing
    assert trip["trainer"]["complete"], text
    assert trip["engine"]["complete"], text
    assert trainer[0] == relative(WeightSender.send.__code__.co_filename), text
    assert trip["trainer"]["stop"] == "the channel's send of the bucket", text
    assert any(path.startswith("aiosync/channels/") for path in trainer), text
    assert engine[0].startswith("aiosync/channels/"), text
    assert relative(ModuleSink.apply_with.__code__.co_filename) in engine, text
    assert trip["union"] == len(set(trainer) | set(engine))
    assert trip["union"] <= TRIP_TODAY, f"the trip grew past {TRIP_TODAY} files:\n{text}"
