"""A plane's ``queue`` hook: the send of a bucket is queued only once it will be published.

A collective plane queues each bucket's broadcast from the packing thread (no hand-over
before the bucket message leaves), once nothing stands between the bucket and its
publishing: bucket 1, packed in the thread that read the version, is queued by the
plane's ``publish`` instead; under policy ``all`` with several engines a refusal of the
begin means it is never published, and a broadcast queued for it would pair with the next
version's first receive. These tests wrap a real plane and record what the pipeline calls.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import anyio
import pytest

from aiosync import RejectedError, SenderConfig, WeightSender
from tests.api.test_stream import bump, receivers, refusing_target
from tests.helpers.models import mixed_weights, zeros_like

SMALL = SenderConfig(buffer_bytes=64 * 1024, num_buffers=2, timeout=10)


class RecordingPlane:
    """The sender's plane, with a ``queue`` hook; records (call, buffer, thread)."""

    def __init__(self, plane: Any) -> None:
        self._plane = plane
        self.calls: list[tuple[str, int, bool]] = []
        self._loop_thread = threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plane, name)

    def _note(self, call: str, index: int) -> None:
        self.calls.append((call, index, threading.get_ident() == self._loop_thread))

    def pack(self, index: int, plan: Any) -> None:
        self._note("pack", index)
        self._plane.pack(index, plan)

    def queue(self, index: int) -> None:
        self._note("queue", index)

    async def publish(self, index: int, used: int) -> None:
        self._note("publish", index)
        await self._plane.publish(index, used)


@pytest.mark.parametrize("engines", [1, 2])
async def test_every_published_bucket_is_queued_in_the_packing_thread(engines: int) -> None:
    base = mixed_weights()
    async with (
        receivers([zeros_like(base) for _ in range(engines)]) as fleet,
        WeightSender([e.endpoint for e in fleet], config=SMALL) as sender,
    ):
        plane = RecordingPlane(sender._plane)
        sender._plane = plane  # type: ignore[assignment]
        report = await sender.send(bump(base, 1), version=0)
    calls = [call for call, _, _ in plane.calls]
    assert calls.count("pack") == calls.count("publish") == report.buckets
    packs = [i for i, (call, _, _) in enumerate(plane.calls) if call == "pack"]
    for n, at in enumerate(packs):  # each pack is followed by its queue, then its publish
        call, index, on_loop = plane.calls[at + 1]
        if n == 0:  # bucket 1, packed as the version was read: its message encoded later
            assert call == "publish"  # the plane queues it itself
        else:
            assert (call, index, on_loop) == ("queue", plane.calls[at][1], False)


async def test_a_bucket_held_back_by_a_refusal_is_never_queued_or_published() -> None:
    base = mixed_weights()
    targets = [zeros_like(base), refusing_target(base)]
    async with (
        receivers(targets) as fleet,
        WeightSender([e.endpoint for e in fleet], config=SMALL) as sender,
    ):
        plane = RecordingPlane(sender._plane)
        sender._plane = plane  # type: ignore[assignment]
        with pytest.raises(RejectedError):
            await sender.send(bump(base, 1), version=0)
    assert [call for call, _, _ in plane.calls] == ["pack"]  # bucket 1, packed meanwhile


async def test_bucket_1_is_packed_in_the_thread_hop_that_read_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One hand-over fewer before the first byte moves (``pipeline/ahead.py``)."""
    from aiosync.trainer import sender as sender_module

    hop: contextvars.ContextVar[int] = contextvars.ContextVar("hop", default=0)
    hops = [0]
    run_sync = anyio.to_thread.run_sync

    async def counted(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops[0] += 1
        token = hop.set(hops[0])  # copied into the worker thread's context
        try:
            return await run_sync(func, *args, **kwargs)
        finally:
            hop.reset(token)

    reads: list[int] = []
    packs: list[int] = []
    read_source = sender_module.read_source

    def reading(*args: Any) -> Any:
        reads.append(hop.get())
        return read_source(*args)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    monkeypatch.setattr(sender_module, "read_source", reading)
    base = mixed_weights()
    async with (
        receivers([zeros_like(base)]) as fleet,
        WeightSender([e.endpoint for e in fleet], config=SMALL) as sender,
    ):
        plane = RecordingPlane(sender._plane)
        pack = plane.pack

        def noting_pack(index: int, plan: Any) -> None:
            packs.append(hop.get())
            pack(index, plan)

        plane.pack = noting_pack  # type: ignore[method-assign]
        sender._plane = plane  # type: ignore[assignment]
        for version in range(2):
            packs.clear()
            report = await sender.send(bump(base, version), version=version)
            assert reads[-1] == packs[0] != 0  # one hop read the version and packed bucket 1
            assert len(set(packs)) == len(packs) == report.buckets > 1  # a hop each after
