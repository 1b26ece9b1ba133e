"""Shared-memory segments: naming, attach checks, and the sweep of dead creators' names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from aiosync.errors import AiosyncError
from aiosync.memory import SHM_DIR, ShmSegment, sweep_stale_segments
from aiosync.wire import ShmHandle


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_segment_round_trip_and_unlink_on_close() -> None:
    segment = ShmSegment.create(4096)
    try:
        segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        other = ShmSegment.attach(segment.handle)
        assert other.tensor[:4].tolist() == [1, 2, 3, 4]
        other.close()
        assert (SHM_DIR / segment.name).exists()  # only the creator unlinks
    finally:
        segment.close()
    assert not (SHM_DIR / segment.name).exists()
    with pytest.raises(AiosyncError, match="closed"):
        _ = segment.tensor


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "aiosync-1-2-zz", "other-1-2-0123456789abcdef", "aiosync-1-abc"]
)
def test_attach_refuses_names_that_are_not_ours(name: str) -> None:
    with pytest.raises(AiosyncError, match="refusing"):
        ShmSegment.attach(ShmHandle(name=name, size=4096))


def test_attach_checks_existence_and_size() -> None:
    segment = ShmSegment.create(4096)
    try:
        with pytest.raises(AiosyncError, match="holds 4096 bytes, not 8192"):
            ShmSegment.attach(ShmHandle(name=segment.name, size=8192))
    finally:
        segment.close()
    with pytest.raises(AiosyncError, match="does not exist"):
        ShmSegment.attach(segment.handle)


def test_sweep_removes_names_of_dead_creators_in_this_namespace_only() -> None:
    namespace = os.stat("/proc/self/ns/pid").st_ino
    pid = dead_pid()
    ours_dead = SHM_DIR / f"aiosync-{namespace}-{pid}-0123456789abcdef"
    other_ns = SHM_DIR / f"aiosync-{namespace + 1}-{pid}-0123456789abcdef"
    alive = ShmSegment.create(4096)
    try:
        ours_dead.write_bytes(b"x")
        other_ns.write_bytes(b"x")
        removed = sweep_stale_segments()
        assert ours_dead.name in removed
        assert not ours_dead.exists()
        assert other_ns.exists()  # a pid of another namespace proves nothing
        assert (SHM_DIR / alive.name).exists()  # its creator (us) is alive
    finally:
        alive.close()
        ours_dead.unlink(missing_ok=True)
        other_ns.unlink(missing_ok=True)
