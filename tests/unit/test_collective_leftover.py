"""A broadcast queued but never announced breaks the group at the next version.

NCCL pairs broadcasts by their order: a broadcast a failed (or cancelled) version queued
but whose bucket never went out would pair with the next version's first receive, and
every later one would shift. The trainer's collective plane notes each broadcast queued
until its bucket is published; the next version's ``begin_version`` breaks the group
instead of letting it go on out of step. The bookkeeping is checked on the CPU with the
plane's NCCL ordering stood in for (the GPU tests run the real thing).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import torch

from aiosync.collectives import Deadline, GroupExecutor
from aiosync.core.errors import PeerGoneError
from aiosync.planes.collective import CollectiveOptions, CollectiveSenderPlane


class _Steps:
    """Stands in for OrderedBroadcasts: each step is recorded, and returns a token."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def step(
        self, group: Any, parts: Any, after: Any, deadline: Deadline, what: str, **_: Any
    ) -> str:
        self.steps.append(what)
        return f"done {len(self.steps)}"


@pytest.fixture
def plane() -> Any:
    executor = GroupExecutor("leftover")
    executor.start()
    made = object.__new__(CollectiveSenderPlane)  # the NCCL side without a GPU or a group
    made.options = CollectiveOptions(engines=1, timeout=5)
    made._name, made._executor, made._ordered = "leftover", executor, _Steps()
    made._ready, made._unpublished, made._done, made._inflight = {}, set(), {}, {}
    made._group = lambda: None  # type: ignore[method-assign]
    made._caller = None
    made._joined = concurrent.futures.Future()
    made._joined.set_result(None)
    made.device = torch.device("cpu")
    yield made
    executor.close()


def ready(plane: Any, index: int) -> None:
    plane._ready[index] = ([torch.zeros(1)], None, None)  # as pack leaves a bucket


async def test_published_broadcasts_leave_the_group_whole(
    plane: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for index in (0, 1):  # queued from the packing thread, then published
        ready(plane, index)
        plane.queue(index)
        await plane.publish(index, 1)
    ready(plane, 0)
    await plane.publish(0, 1)  # bucket 1 of a version: publish queues it itself
    assert plane._ordered.steps == [f"broadcast from buffer {i}" for i in (0, 1, 0)]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the caller's")
    plane.begin_version()
    assert plane._executor.broken is None
    assert plane._caller == "the caller's"


async def test_a_queued_broadcast_never_published_breaks_the_next_version(plane: Any) -> None:
    ready(plane, 0)
    plane.queue(0)  # then the version failed before publishing it
    ready(plane, 1)  # packed, never queued: nothing to pair with
    with pytest.raises(PeerGoneError, match="out of step"):
        plane.begin_version()
    assert isinstance(plane._executor.broken, PeerGoneError)
    assert plane._ready == {}
