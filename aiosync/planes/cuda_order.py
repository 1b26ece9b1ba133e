"""How an engine tells a CUDA plane that a bucket's copies are queued (no host wait).

A plane that orders copies with CUDA events (:class:`~aiosync.planes.cuda.CudaReceiverPlane`)
makes the applying thread's stream wait for the trainer's packing
in :meth:`view`, and records its own event once the copies are queued (``applied(index)``);
the trainer waits on that event before it packs the buffer again. The host never waits.
While such an apply runs, :func:`sync_deferred` is true in that thread, and sinks skip their
own device synchronisation (it happens once per version, at commit). Planes without
``applied`` are untouched: the sink synchronises as before.

A collective plane queues its receives without a host wait (NCCL) and must join every
broadcast of its group: :func:`receive_through_plane` is how the receiver hands it each
message (``settle`` before a version is called whole, ``skip`` for a refused bucket).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec

from aiosync.core.engine_actions import Action, Apply, ClosePlane, Peer, Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError
from aiosync.core.wire import Bucket, Complete, Message, Ready
from aiosync.planes.cuda_copies import hint_scope

log = logging.getLogger(__name__)
_local = threading.local()


def sync_deferred() -> bool:
    """Whether this thread applies a bucket whose copies a CUDA plane orders with events."""
    return bool(getattr(_local, "deferred", False))


@contextmanager
def ordered_apply(plane: Any, index: int) -> Iterator[None]:
    """Around one bucket's apply: defer sinks' device waits; then record the plane's event.

    The copies' hints (:func:`~aiosync.planes.cuda_copies.hint_scope`) last the bucket.
    """
    applied = getattr(plane, "applied", None) if getattr(plane, "events", None) else None
    with hint_scope():
        if applied is None:
            yield
            return
        _local.deferred = True
        try:
            yield
        finally:
            _local.deferred = False
            applied(index)  # also after a failure: the trainer must not wait for ever


def with_plane_events(actions: list[Action], plane: Any) -> list[Action]:
    """``actions`` with the plane's IPC event handles added to the ready it answers with."""
    events = getattr(plane, "events", None)
    if not events:
        return actions
    return [
        Reply(a.peer, msgspec.structs.replace(a.message, events=list(events)))
        if isinstance(a, Reply) and isinstance(a.message, Ready)
        else a
        for a in actions
    ]


async def receive_through_plane(
    plane: Any, machine: EngineSession, peer: Peer, message: Message, in_thread: bool
) -> list[Action]:
    """``machine.receive(peer, message)``, with the hooks of a plane that queues collectives.

    ``in_thread``: receive in a worker thread, unless the machine says the message's
    checks are bounded work now (``machine.light``: no thread hop). The hooks are
    duck-typed (other planes are untouched):

    - before a ``complete``, ``plane.settle()`` waits for the receives still queued on the
      GPU (under the plane's deadline); a failure refuses the completion;
    - a ``bucket`` the engine refused (or one of a refused version) still has its
      broadcast joined by ``plane.skip``, into the plane's buffer, and dropped: every rank
      of a group takes part in every broadcast, so the other engines complete.
    """
    if isinstance(message, Complete) and (error := await _settled(plane)):
        return machine.apply_failed(peer, message.seq, error)
    now = time.monotonic()
    if in_thread and machine.light(peer, message):  # an unchanged manifest, a count check
        in_thread = False
    if in_thread:
        actions = await anyio.to_thread.run_sync(machine.receive, peer, message, now)
    else:
        actions = machine.receive(peer, message, now)
    skip = getattr(plane, "skip", None)
    if skip is None or not isinstance(message, Bucket):
        return actions
    if any(isinstance(action, Apply | ClosePlane) for action in actions):
        return actions  # applied as usual, or the session is over (a protocol error)
    slots = [(s.offset, s.nbytes) for s in message.slots] or [
        (s.offset, s.nbytes) for s in message.specs
    ]
    try:
        await anyio.to_thread.run_sync(skip, message.buffer, message.used, slots)
    except Exception as exc:  # the group breaks; this engine's refusal stands either way
        log.warning("could not join the broadcast of refused bucket %d: %s", message.seq, exc)
    return actions


async def _settled(plane: Any) -> AiosyncError | None:
    """Wait (in a worker thread) for ``plane.settle()`` if it has one; the error it raised."""
    settle = getattr(plane, "settle", None)
    if settle is None:
        return None
    try:
        await anyio.to_thread.run_sync(settle)
    except AiosyncError as exc:
        return exc
    except Exception as exc:
        return AiosyncError(f"a queued receive failed: {exc}")
    return None
