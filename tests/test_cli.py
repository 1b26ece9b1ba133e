"""The `aiosync` command as a user runs it (small sizes; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from aiosync.runtime import child_env


def aiosync(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosync.cli", *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_verifies_every_version_and_reports_json() -> None:
    out = aiosync("demo", "--device", "cpu", "--size-mb", "16", "--versions", "3", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["versions_verified"] == [0, 1, 2]
    assert summary["bytes_per_version"] > 15 * 2**20
    assert len(summary["seconds"]) == 3
    assert "version 2" in out.stderr  # progress was shown


def test_bench_prints_one_json_object_last_with_every_figure() -> None:
    out = aiosync("bench", "--device", "cpu", "--size-mb", "16", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("bytes", "seconds", "GBps", "memcpy_GBps", "trainer_seconds", "engine_seconds"):
        assert result[key] > 0, key
    for baseline in ("torch_save_zmq", "safetensors_shm"):
        assert result[baseline]["verified"] is True
        assert result[baseline]["seconds"] > 0


def test_bad_arguments_exit_with_usage() -> None:
    out = aiosync("demo", "--size-mb", "lots")
    assert out.returncode == 2
    assert "invalid int value" in out.stderr


def test_demo_fails_cleanly_when_the_trainer_cannot_run() -> None:
    # A buffer below the minimum makes the trainer refuse its configuration at start.
    out = aiosync("demo", "--device", "cpu", "--size-mb", "8", "--buffer-mb", "0", "--json")
    assert out.returncode == 1
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] is False
    assert summary["versions_verified"] == []
    assert "buffer_bytes must be at least" in out.stderr
