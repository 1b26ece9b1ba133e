"""The data-plane interface: how a packed bucket's bytes reach an engine.

A sender's plane owns a ring of buffers. The pipeline packs a bucket into buffer ``i``
(:meth:`SenderPlane.pack`, blocking, in a worker thread), then :meth:`SenderPlane.publish`
makes those bytes visible to the engines (a no-op for memory they map, a broadcast for a
collective, a send for a network relay). The plane is described to engines once per
session (:attr:`SenderPlane.spec`, carried by the hello); an engine turns that description
into a :class:`ReceiverPlane` and reads each bucket with :meth:`ReceiverPlane.view`.

What later planes need fits here without touching the pipeline: a collective plane
broadcasts in ``publish`` and receives in ``view``; a direct plane exports the trainer's
own tensors from ``pack`` (the spec then grows per bucket); a relay plane sends and
receives bytes over tcp; several producers each own a plane that one engine opens.
"""

from __future__ import annotations

from typing import Protocol

import torch

from aiosync.core.layout import BucketPlan
from aiosync.core.wire import PlaneSpec


class SenderPlane(Protocol):
    """The trainer's side of a data plane: a ring of buffers to pack and publish.

    Optional hooks the pipeline looks up by name, where a plane needs them:
    ``begin_version()`` (on the caller's thread, before a version's first pack: a CUDA
    plane takes the caller's stream), ``queue(index)`` (in the packing thread after ``pack``,
    once nothing stands between the bucket and its publishing: its message encoded, the
    engines' answers to the begin in; a collective plane queues its broadcast there, and
    ``publish`` does what ``queue`` was not called for), ``consumed(index,
    events)`` (an engine acked the buffer: its reads' events), ``drain()`` (after the last
    bucket, before the trainer's tensors are free: sends still reading them), and
    ``joins_all`` (every engine takes part in every send, even one it refused).
    """

    @property
    def spec(self) -> PlaneSpec:
        """Plain data from which an engine opens this plane (sent in the hello)."""

    @property
    def capacity(self) -> int:
        """Bytes of each buffer (a multiple of the layout's alignment)."""

    @property
    def count(self) -> int:
        """Number of buffers in the ring (the most buckets in flight)."""

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Copy ``plan``'s tensors into buffer ``index`` and wait until the bytes are there.

        Blocking; the pipeline calls it from a worker thread.
        """

    async def publish(self, index: int, used: int) -> None:
        """Make the first ``used`` bytes of buffer ``index`` visible to every engine."""

    def close(self) -> None:
        """Release the buffers (idempotent)."""


class ReceiverPlane(Protocol):
    """The engine's side of a data plane."""

    def view(self, index: int, used: int) -> torch.Tensor:
        """The first ``used`` bytes of buffer ``index`` as flat ``uint8`` (valid until acked)."""

    def close(self) -> None:
        """Release this engine's hold on the buffers (idempotent)."""
