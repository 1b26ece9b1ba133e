"""Shared fixtures: event-loop flavours, leak checks for shared memory and threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch

from aiosync.runtime import uvloop_available

SHM = Path("/dev/shm")


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


def aiosync_segments() -> set[str]:
    """Names of aiosync shared-memory segments present now."""
    return {p.name for p in SHM.glob("aiosync-*")}


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
