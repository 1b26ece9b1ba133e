"""Shared fixtures: event-loop flavours, leak checks for shared memory and threads.

Hypothesis profiles: "ci" (the default, and what CI runs) is derandomized with a fixed
number of examples, so a run is repeatable; "wide" tries many more random examples. Choose
with ``HYPOTHESIS_PROFILE=wide pytest ...`` (or pytest's ``--hypothesis-profile wide``).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from aiosync.runtime import uvloop_available

SHM = Path("/dev/shm")

# Replaces Hypothesis's own "ci" profile (which it loads when CI is set) with a fixed one.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=50,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "wide",
    derandomize=False,
    max_examples=2_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every async test on plain asyncio and, where installed, on uvloop."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop_available():
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


# Segment names carry their creator: aiosync-<pid namespace>-<pid>-<token> (the library's
# buffers) and aiosync-bench-<pid>-<token>.safetensors (the bench baseline's files).
_SEGMENT_CREATOR = re.compile(r"^aiosync-(?:(?P<ns>\d+)|bench)-(?P<pid>\d+)-")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _from_another_run(name: str) -> bool:
    """Whether a segment belongs to a live process that is not this one nor one it started.

    Other test runs on the same machine (another checkout, a concurrent CI job) create and
    remove segments in the same /dev/shm; those are not this test's leaks. A segment whose
    creator is gone still counts: it may be a peer that the test killed.
    """
    match = _SEGMENT_CREATOR.match(name)
    if match is None:
        return False
    if match["ns"] is not None and int(match["ns"]) != _pid_namespace():
        return True
    pid: int | None = int(match["pid"])
    if _parent_pid(pid) is None:  # not alive
        return False
    while pid is not None and pid > 1:
        if pid == os.getpid():
            return False
        pid = _parent_pid(pid)
    return True


def aiosync_segments() -> set[str]:
    """Names of aiosync shared-memory segments present now, less those of other runs."""
    return {p.name for p in SHM.glob("aiosync-*") if not _from_another_run(p.name)}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test must leave /dev/shm as it found it."""
    before = aiosync_segments()
    yield
    leaked = aiosync_segments() - before
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail if the test leaves extra non-daemon threads running."""
    before = set(threading.enumerate())
    yield
    extra = [t for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()]
    assert not extra, f"test leaked threads: {extra}"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
