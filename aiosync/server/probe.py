"""Whether a new subscriber's receiver answers at all, before it takes a subscriber slot.

A subscription is counted only once its receiver answered a ``hello``: the server opens a
session on a plane of one small segment of its own (:func:`probe_segment`, no version's
bytes), reads the ``ready`` and says goodbye, all within :data:`HELLO_BOUND` (or the
server's timeout if shorter). A receiver that never answers, or an endpoint nobody serves,
so never holds a slot until the next version is published; the subscriber is refused,
saying why, and may subscribe again.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import anyio

from aiosync.channels.base import Channel
from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import Abort, Ready, ShmPlaneSpec, decode, encode
from aiosync.pipeline.links import EngineLink
from aiosync.planes.memfd import BACKEND_ENV, memfd_available
from aiosync.planes.shm import ShmSegment

HELLO_BOUND = 10.0
"""Seconds a new subscriber's receiver has to answer the server's first hello."""

PROBE_BYTES = 4096
"""Bytes of the segment a probe's session names (one page; nothing is ever read from it)."""

CLOSE_TIMEOUT = 1.0  # seconds for the probe's goodbye


def probe_segment() -> ShmSegment:
    """The one-page segment every probe names (a sealed memfd where one can be made)."""
    if memfd_available() and os.environ.get(BACKEND_ENV, "").strip().lower() != "file":
        return ShmSegment.create(PROBE_BYTES, backend="memfd", seal_writes=True)
    return ShmSegment.create(PROBE_BYTES, backend="file")


async def probe(
    channel: Channel, name: str, segment: ShmSegment, *, sender: str, timeout: float
) -> str | None:
    """Why the receiver on ``channel`` is not taken on (None: it answered a hello in time).

    ``name`` is the subscriber's (for the session), ``sender`` the server's.
    """
    session = LinkSession(name, uuid.uuid4().hex)
    hello = session.hello(sender, ShmPlaneSpec([segment.handle]))
    reply = None
    with anyio.move_on_after(timeout):
        try:
            await channel.send(encode(hello))
            reply = decode(await channel.recv())
        except AiosyncError as exc:
            return f"its receiver cannot be reached: {exc.reason}"
    if reply is None:
        return f"its receiver did not answer a hello within {timeout:g}s"
    if isinstance(reply, Abort):
        return f"its receiver refused a session: {reply.reason}"
    if not isinstance(reply, Ready):
        return f"its receiver answered a hello with {type(reply).__name__.lower()}"
    try:
        session.ready(reply)
    except ProtocolError as exc:
        return f"its receiver answered a hello wrongly: {exc.reason}"
    # it answered the hello: a goodbye it misses ends at its session timeout
    with anyio.move_on_after(CLOSE_TIMEOUT, shield=True), contextlib.suppress(AiosyncError):
        await EngineLink(channel, session, timeout).goodbye()
    return None
