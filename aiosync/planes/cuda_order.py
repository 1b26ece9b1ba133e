"""How an engine tells a CUDA plane that a bucket's copies are queued (no host wait).

A plane that orders copies with CUDA events (:class:`~aiosync.planes.cuda_legacy.
CudaLegacyReceiverPlane`) makes the applying thread's stream wait for the trainer's packing
in :meth:`view`, and records its own event once the copies are queued (``applied(index)``);
the trainer waits on that event before it packs the buffer again. The host never waits.
While such an apply runs, :func:`sync_deferred` is true in that thread, and sinks skip their
own device synchronisation (it happens once per version, at commit). Planes without
``applied`` are untouched: the sink synchronises as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from aiosync.core.engine_actions import Action, Reply
from aiosync.core.wire import Ready

_local = threading.local()


def sync_deferred() -> bool:
    """Whether this thread applies a bucket whose copies a CUDA plane orders with events."""
    return bool(getattr(_local, "deferred", False))


@contextmanager
def ordered_apply(plane: Any, index: int) -> Iterator[None]:
    """Around one bucket's apply: defer sinks' device waits; then record the plane's event."""
    applied = getattr(plane, "applied", None) if getattr(plane, "events", None) else None
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
