"""Stream one retained version to one subscriber, as a trainer would, from shared memory.

Towards a subscriber the server is a sender: each transfer is a session of the ordinary
protocol (:mod:`aiosync.core.wire`) on the subscriber's channel, and the version goes
through the trainer's own send loop (:class:`~aiosync.pipeline.stream.StreamRun`). The
hello names the retained version's segments as the data plane (:class:`RetainedPlane`:
the subscriber maps them; the server copies nothing); then ``begin`` with the manifest,
and once it is accepted every bucket (at most ``window`` awaiting their ack),
``complete``, ``commit`` once the completion is acked (:attr:`VersionSpec.stepwise
<aiosync.pipeline.version_spec.VersionSpec.stepwise>`), and ``goodbye``, each wait
bounded by the link's timeout. The subscriber's receiver applies every check, limit and
lease it applies to a trainer.

A subscriber that resumes (it keeps buckets by content, :mod:`aiosync.engine.held`) gets
each bucket's digest in its ``bucket`` message; a bucket whose digest it said it holds is
sent as ``held``: same seq, specs and checks, but the engine reads the bytes from its own
store, not from the server's memory, and the server counts them as held, not sent.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from aiosync.channels.base import Channel
from aiosync.core.errors import AiosyncError, BusyError, RejectedError
from aiosync.core.layout import BucketPlan
from aiosync.core.trainer_session import LinkSession, Policy
from aiosync.core.wire import PlaneSpec
from aiosync.pipeline.links import EngineLink
from aiosync.pipeline.stream import StreamRun
from aiosync.pipeline.version_spec import VersionSpec
from aiosync.planes.base import SenderPlane, StoredPlan
from aiosync.server.fleet import SubscriberState
from aiosync.server.store import RetainedVersion

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 1.0  # seconds for the goodbye at the end of a transfer
BUSY_RETRY = 0.5  # seconds before a busy subscriber is sent the version again


@dataclass(frozen=True)
class Transfer:
    """How one transfer ended: the subscriber's version now, and the buckets it was sent.

    (Their bytes, streamed or held, went to the transfer's :data:`Counter` as they went.)
    """

    version: int | None
    buckets_sent: int


Counter = Callable[[int, bool], None]
"""Called with each bucket's bytes as it goes out, and whether the subscriber held it."""


def counter(state: SubscriberState, metrics: Any = None) -> Counter:
    """A :data:`Counter` adding to ``state``'s bytes sent or held (and to ``metrics``)."""

    def count(nbytes: int, held: bool) -> None:
        if held:
            state.bytes_held += nbytes
        else:
            state.bytes_sent += nbytes
        if metrics is not None:
            (metrics.bytes_held if held else metrics.bytes_out).inc(nbytes)

    return count


async def feed_version(
    channel: Channel,
    state: SubscriberState,
    retained: RetainedVersion,
    *,
    sender: str,
    timeout: float,
    window: int,
    counted: Counter | None = None,
) -> Transfer:
    """:func:`send_version` to one subscriber, skipping the buckets it holds.

    A subscriber that resumes gets bucket digests, and the buckets it said it holds go as
    ``held``. A refusal while some were held (say its store failed one) is retried once
    with every bucket sent. Once it committed (or refused) it holds nothing; a busy one
    still holds them.
    """
    digests = await anyio.to_thread.run_sync(retained.digests) if state.resume else None
    held = state.held if digests is not None else frozenset()
    if held:
        count = sum(digest in held for digest in digests or ())
        log.debug("%s holds %d buckets of version %d", state.name, count, retained.version)
    for attempt in (held, frozenset()) if held else (held,):
        try:
            done = await send_version(
                channel,
                state.name,
                retained,
                digests,
                attempt,
                sender=sender,
                timeout=timeout,
                window=window,
                counted=counted,
            )
            state.held = frozenset()  # it committed: its store is empty
            return done
        except RejectedError as exc:
            if isinstance(exc, BusyError):
                raise  # it still holds them: the next try skips them too
            state.held = frozenset()  # refused: what it holds is not trusted again
            if not attempt or channel.lost.is_set():
                raise
            log.warning("%s refused held buckets (%s): sending every bucket", state.name, exc)
    raise AssertionError("unreachable")  # the last attempt returns or raises


class RetainedPlane(SenderPlane):
    """A retained version's segments as a sender's plane: buffer ``i`` holds bucket ``i``.

    Nothing is packed or published (a subscriber maps the segments); the ring of
    :attr:`count` = ``window`` slots only bounds the buckets awaiting a subscriber's ack.
    """

    prepacked = True

    def __init__(self, retained: RetainedVersion, window: int) -> None:
        self.retained = retained
        self.window = window

    @property
    def spec(self) -> PlaneSpec:
        """The retained version's segments."""
        return self.retained.spec

    @property
    def capacity(self) -> int:
        """The largest bucket's bytes."""
        return max((bucket.used for bucket in self.retained.buckets), default=0)

    @property
    def count(self) -> int:
        """The window: buckets in flight at most."""
        return self.window

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Nothing: the bytes lie in their segment already."""

    async def publish(self, index: int, used: int) -> None:
        """Nothing: the subscriber maps the segments."""

    def close(self) -> None:
        """Nothing: the segments are the store's."""


async def send_version(
    channel: Channel,
    name: str,
    retained: RetainedVersion,
    digests: list[bytes] | None = None,
    held: frozenset[bytes] = frozenset(),
    *,
    sender: str,
    timeout: float,
    window: int,
    counted: Counter | None = None,
) -> Transfer:
    """Stream ``retained`` to the receiver on ``channel`` (named ``name``) and commit it.

    One session (hello to goodbye) around a :class:`~aiosync.pipeline.stream.StreamRun`
    over the version's segments (:class:`RetainedPlane`), at most ``window`` buckets
    awaiting their ack. A subscriber that already holds the version is sent nothing; one
    that holds a newer version gets it as a rebase (a fetch of an older version, which its
    limits must allow). ``digests`` (one per bucket) name each bucket by content; those in
    ``held`` go as ``held`` (the subscriber's own bytes). ``counted`` hears of each
    bucket's bytes. Raises the subscriber's refusal, or a timeout or lost-peer error,
    naming it.
    """
    link = EngineLink(channel, LinkSession(name, uuid.uuid4().hex), timeout)
    plane = RetainedPlane(retained, window)
    ready = await link.handshake(link.session.hello(sender, plane.spec))
    version = retained.version

    def sent(plan: BucketPlan) -> None:
        if counted is not None:
            counted(plan.used, isinstance(plan, StoredPlan) and plan.held)

    rebase = ready.version is not None and version < ready.version
    spec = VersionSpec(version, retained.manifest, rebase=rebase, on_sent=sent, stepwise=True)
    run = StreamRun(links=[link], plane=plane, policy=Policy.ALL, spec=spec)
    try:
        report = await run.run(iter(retained.plans(digests, held)))
        return Transfer(version, report.buckets)
    finally:
        with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
            try:
                await link.goodbye()  # the subscriber unmaps the version's segments
            except AiosyncError as exc:
                log.debug("goodbye to %s failed: %s", name, exc)


def is_refusal(exc: AiosyncError) -> bool:
    """Whether the subscriber refused the version (its session is still good)."""
    return isinstance(exc, RejectedError)


async def retried(exc: AiosyncError, channel: Channel) -> bool:
    """Whether to send the same version again, after a short wait: the subscriber was busy.

    Busy: another stream holds its sink, say that of a transfer that broke without the
    engine hearing of it, until that stream expires there.
    """
    if not isinstance(exc, BusyError) or channel.lost.is_set():
        return False
    log.debug("subscriber %s busy: %s", channel.peer, exc)
    await anyio.sleep(BUSY_RETRY)
    return True


async def gone_while_idle(changed: anyio.Event, channel: Channel) -> bool:
    """Wait for ``changed`` while watching an idle subscriber's channel; True if it is gone.

    Reading is what notices a receiver that went away (its process died or it left); a
    message it sends while idle is dropped.
    """
    gone = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            try:
                while True:
                    await channel.recv()  # nothing is due while idle: dropped
                    log.debug("dropped a message from idle subscriber %s", channel.peer)
            except AiosyncError as exc:
                log.debug("subscriber %s gone: %s", channel.peer, exc)
                gone = True
                tg.cancel_scope.cancel()

        async def wait() -> None:
            await changed.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(wait)
    return gone
