"""The two-GPU colocated run (tests/helpers/colocate_gpu.py), and its scaled-down CPU twin in CI.

Both start an engine process spanning two devices, served over aiosync's control channel
(a :class:`~aiosync.handles.ChannelHandle` on the source rank), and two trainer processes
in a Gloo world; every version must arrive bit-exact on both of the engine's devices.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from aiosync.runtime import child_env, stop_process
from tests.conftest import requires_two_gpus

GUARD = 175  # seconds: the GPU run must finish unattended within 3 minutes


def _run(*args: str) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.colocate_gpu", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        out, _ = proc.communicate(timeout=GUARD)
    finally:
        stop_process(proc, grace=10)
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.strip()]


def test_scaled_down_run_on_the_cpu_is_bit_exact_through_an_engine_process() -> None:
    code, lines = _run("--tiny", "--versions", "3", "--bucket-mb", "0.05")
    summary = lines[-1]["summary"]
    assert code == 0, lines
    assert summary["ok"] is True
    sources = [line for line in lines if "exact" in line]
    assert [line["engine_version"] for line in sources] == [str(v) for v in range(1, 7)]
    assert all(line["check"] == "bit-exact" for line in sources)
    assert all(line["buckets"] > 1 for line in sources)  # several buckets, and a commit


@pytest.mark.gpu
@pytest.mark.multigpu
@requires_two_gpus
def test_two_h200s_one_engine_over_both_gpus_is_bit_exact() -> None:
    code, lines = _run("--versions", "4")
    print(json.dumps(lines))  # the timings, for docs/benchmarks.md
    summary = lines[-1]["summary"]
    assert code == 0, lines
    assert summary["ok"] is True
    assert summary["bytes_per_rank"] == 16_060_522_496
