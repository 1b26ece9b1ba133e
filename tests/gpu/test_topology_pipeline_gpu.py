"""The native-pipeline colocated run on two GPUs (tests/helpers/colocate_pipeline_gpu.py),
and its CPU twin.

Both start an engine process (a WeightReceiver over a RankedSink with one sink per device)
and two trainer ranks in a Gloo world, each sending its own shard through a
ColocatedSession; every version must arrive bit-exact on both of the engine's devices. On
GPUs rank r's CUDA IPC buffers are on cuda:r and the engine opens and applies them there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from aiosync.runtime import child_env, stop_process
from tests.conftest import requires_two_gpus

GUARD = 110  # seconds: the driver gives up after 90 on its own


def _run(*args: str) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.colocate_pipeline_gpu", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        out, _ = proc.communicate(timeout=GUARD)
    finally:
        stop_process(proc, grace=10)
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.strip()]


def _check(code: int, lines: list[dict[str, Any]], devices: list[str]) -> None:
    assert code == 0, lines
    summary = lines[-1]["summary"]
    assert summary["ok"] is True, lines
    assert summary["devices"] == devices
    checks = [line for line in lines if "exact" in line]
    assert [c["engine_version"] for c in checks] == [1, 2]
    assert all(c["exact"] for c in checks), checks
    assert all(c["seen"] == [[d] for d in devices] for c in checks)  # part r read on device r
    sources = [line for line in lines if "buckets" in line]
    assert [s["version"] for s in sources] == [1, 2]
    assert all(s["buckets"] > 2 for s in sources)  # several buckets of each rank


def test_scaled_down_run_on_the_cpu_is_bit_exact_through_an_engine_process() -> None:
    code, lines = _run("--tiny", "--versions", "2")
    _check(code, lines, ["cpu", "cpu"])


@pytest.mark.gpu
@pytest.mark.multigpu
@requires_two_gpus
def test_two_gpus_one_engine_over_both_through_the_pipeline_is_bit_exact() -> None:
    code, lines = _run("--versions", "2")
    print(json.dumps(lines))
    _check(code, lines, ["cuda:0", "cuda:1"])
