"""How an engine tells a CUDA plane that a bucket's copies are queued (no host wait).

A plane that orders copies with CUDA events (:class:`~aiosync.planes.cuda.CudaReceiverPlane`)
makes the applying thread's stream wait for the trainer's packing in :meth:`view`, and
records its own event once the copies are queued (``applied(index)``); the trainer waits
on that event before it packs the buffer again. The host never waits. Such a bucket's
:class:`~aiosync.planes.base.BucketContext` (:func:`ordered_apply` makes one per bucket)
says ``deferred``, and sinks skip their own device synchronisation (it happens once per
version, at commit). Planes without ``events`` (shared memory, an unordered CUDA plane)
are untouched: the sink synchronises as before.

A collective plane (:attr:`~aiosync.planes.base.ReceiverPlane.joins_all`) queues its
receives without a host wait (NCCL) and must join every broadcast of its group:
:func:`receive_through_plane` is how the receiver hands it each message (``settle`` before
a version is called whole, ``skip`` for a refused bucket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import msgspec

from aiosync.core.engine_actions import Action, Apply, ClosePlane, Peer, Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError
from aiosync.core.wire import Bucket, Complete, Message, Ready
from aiosync.planes.base import BucketContext, ReceiverPlane

log = logging.getLogger(__name__)


@contextmanager
def ordered_apply(plane: ReceiverPlane, index: int) -> Iterator[BucketContext]:
    """One bucket's apply: its context, ``deferred`` where the plane orders copies by events.

    Then (also after a failure: the trainer must not wait for ever) the plane records its
    event (``applied``). The copies' hints in the context last the bucket.
    """
    context = BucketContext(deferred=bool(plane.events))
    if not context.deferred:
        yield context
        return
    try:
        yield context
    finally:
        plane.applied(index)


def with_plane_events(actions: list[Action], plane: ReceiverPlane) -> list[Action]:
    """``actions`` with the plane's IPC event handles added to the ready it answers with."""
    events = plane.events
    if not events:
        return actions
    return [
        Reply(a.peer, msgspec.structs.replace(a.message, events=list(events)))
        if isinstance(a, Reply) and isinstance(a.message, Ready)
        else a
        for a in actions
    ]


async def receive_through_plane(
    plane: ReceiverPlane | None,
    machine: EngineSession,
    peer: Peer,
    message: Message,
    in_thread: bool,
) -> list[Action]:
    """``machine.receive(peer, message)``, with the hooks of a plane that queues collectives.

    ``in_thread``: receive in a worker thread, unless the machine says the message's
    checks are bounded work now (``machine.light``: no thread hop). ``plane``: the peer's,
    once open. For a plane that :attr:`~aiosync.planes.base.ReceiverPlane.joins_all` (other
    planes are untouched):

    - before a ``complete``, ``plane.settle()`` waits for the receives still queued on the
      GPU (under the plane's deadline); a failure refuses the completion;
    - a ``bucket`` the engine refused (or one of a refused version) still has its
      broadcast joined by ``plane.skip``, into the plane's buffer, and dropped: every rank
      of a group takes part in every broadcast, so the other engines complete.
    """
    collective = plane is not None and plane.joins_all
    if collective and isinstance(message, Complete) and (error := await _settled(plane)):
        return machine.apply_failed(peer, message.seq, error)
    now = time.monotonic()
    if in_thread and machine.light(peer, message):  # an unchanged manifest, a count check
        in_thread = False
    if in_thread:
        actions = await anyio.to_thread.run_sync(machine.receive, peer, message, now)
    else:
        actions = machine.receive(peer, message, now)
    if plane is None or not collective or not isinstance(message, Bucket):
        return actions
    if any(isinstance(action, Apply | ClosePlane) for action in actions):
        return actions  # applied as usual, or the session is over (a protocol error)
    slots = [(s.offset, s.nbytes) for s in message.slots] or [
        (s.offset, s.nbytes) for s in message.specs
    ]
    try:
        await anyio.to_thread.run_sync(plane.skip, message.buffer, message.used, slots)
    except Exception as exc:  # the group breaks; this engine's refusal stands either way
        log.warning("could not join the broadcast of refused bucket %d: %s", message.seq, exc)
    return actions


async def _settled(plane: ReceiverPlane | None) -> AiosyncError | None:
    """Wait (in a worker thread) for ``plane.settle()``; the error it raised."""
    if plane is None:
        return None
    try:
        await anyio.to_thread.run_sync(plane.settle)
    except AiosyncError as exc:
        return exc
    except Exception as exc:
        return AiosyncError(f"a queued receive failed: {exc}")
    return None
