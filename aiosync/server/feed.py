"""Stream one retained version to one subscriber, as a trainer would, from shared memory.

Towards a subscriber the server is a sender: each transfer is a session of the ordinary
protocol (:mod:`aiosync.core.wire`) on the subscriber's channel. The hello names the
retained version's segments as the data plane (the subscriber maps them; the server copies
nothing); then ``begin`` with the manifest, every bucket (at most ``window`` awaiting their
ack), ``complete``, ``commit`` and ``goodbye``, each wait bounded by the link's timeout.
The subscriber's receiver applies every check, limit and lease it applies to a trainer.

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
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import (
    GOODBYE_SEQ,
    Abort,
    Ack,
    Begin,
    Bucket,
    Commit,
    Complete,
    Goodbye,
    decode,
    encode,
)
from aiosync.pipeline.links import EngineLink
from aiosync.server.fleet import SubscriberState
from aiosync.server.store import RetainedVersion

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 1.0  # seconds for the goodbye or abort at the end of a transfer
BUSY_RETRY = 0.5  # seconds before a busy subscriber is sent the version again


@dataclass(frozen=True)
class Transfer:
    """How one transfer ended: the subscriber's version now, bytes streamed, buckets.

    ``bytes_held``: bytes of buckets it held already (named, not streamed).
    """

    version: int | None
    bytes_sent: int
    buckets_sent: int
    bytes_held: int = 0


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

    A subscriber that already holds the version is sent nothing; one that holds a newer
    version gets it as a rebase (a fetch of an older version, which its limits must allow).
    ``digests`` (one per bucket) name each bucket by content; those in ``held`` go as
    ``held`` (the subscriber's own bytes). ``counted`` hears of each bucket's bytes.
    Raises the subscriber's refusal, or a timeout or lost-peer error, naming it.
    """
    link = EngineLink(channel, LinkSession(name, uuid.uuid4().hex), timeout)
    ready = await link.handshake(link.session.hello(sender, retained.spec))
    version = retained.version
    try:
        if ready.version == version:
            return Transfer(version, 0, 0)
        rebase = ready.version is not None and version < ready.version
        if rebase:
            link.session.remote_version = None  # the numbering restarts for this engine
        link.session.begin(version)
        manifest: list[object] | None = list(retained.manifest)
        limits = link.session.limits
        begin = encode(Begin(version, retained.manifest, rebase=rebase))
        if len(retained.manifest) > limits.max_manifest_tensors or (
            len(begin) > limits.max_message_bytes
        ):
            manifest = None
            begin = encode(Begin(version, None, rebase=rebase))
        await link.request(begin, 0, "the version's manifest", version)
        sent = kept = 0
        for seq, bucket in enumerate(retained.buckets, start=1):
            while link.session.in_flight >= window:
                await _acked(link, version)
            digest = None if digests is None else digests[seq - 1]
            message = Bucket(
                version,
                seq,
                seq - 1,
                bucket.used,
                slots=[] if manifest is None else bucket.slots,
                specs=bucket.specs if manifest is None else [],
                digest=digest,
                held=digest in held,
            )
            await link.send(encode(message), f"bucket {seq}", version)
            link.session.sent(seq)
            if counted is not None:
                counted(bucket.used, digest in held)
            if digest in held:
                kept += bucket.used
            else:
                sent += bucket.used
        while link.session.in_flight:
            await _acked(link, version)
        count = len(retained.buckets)
        complete = Complete(version, count + 1, count, retained.tensors)
        await link.request(encode(complete), count + 1, "completion check", version)
        commit = Commit(version, count + 2, deadline=link.commit_deadline())
        await link.request(encode(commit), count + 2, "commit", version, commit=True)
        link.session.committed()
        return Transfer(version, sent, count, kept)
    except BaseException:
        link.session.failed()
        with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
            try:
                await channel.send(encode(Abort("the server abandoned the transfer", version)))
            except AiosyncError as exc:
                log.debug("could not tell %s to abort: %s", name, exc)
        raise
    finally:
        with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
            try:
                await _goodbye(link)
            except AiosyncError as exc:
                log.debug("goodbye to %s failed: %s", name, exc)


async def _acked(link: EngineLink, version: int) -> None:
    ack = await link.recv_ack("ack for a bucket", version)
    if not ack.ok:
        raise link.refusal(ack, "bucket")


async def _goodbye(link: EngineLink) -> None:
    """End the session (the subscriber unmaps the version's segments)."""
    await link.channel.send(encode(Goodbye(session=link.session.session)))
    while True:
        reply = decode(await link.channel.recv())
        if isinstance(reply, Ack) and reply.seq == GOODBYE_SEQ:
            return


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
