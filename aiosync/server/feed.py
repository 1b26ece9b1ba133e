"""Stream one retained version to one subscriber, as a trainer would, from shared memory.

Towards a subscriber the server is a sender: each transfer is a session of the ordinary
protocol (:mod:`aiosync.core.wire`) on the subscriber's channel. The hello names the
retained version's segments as the data plane (the subscriber maps them; the server copies
nothing); then ``begin`` with the manifest, every bucket (at most ``window`` awaiting their
ack), ``complete``, ``commit`` and ``goodbye``, each wait bounded by the link's timeout.
The subscriber's receiver applies every check, limit and lease it applies to a trainer.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import anyio

from aiosync.channels.base import Channel
from aiosync.core.errors import AiosyncError, RejectedError
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
from aiosync.server.store import RetainedVersion

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 1.0  # seconds for the goodbye or abort at the end of a transfer


@dataclass(frozen=True)
class Transfer:
    """How one transfer ended: the version the subscriber holds now, and bytes streamed."""

    version: int | None
    bytes_sent: int
    buckets_sent: int


async def send_version(
    channel: Channel,
    name: str,
    retained: RetainedVersion,
    *,
    sender: str,
    timeout: float,
    window: int,
) -> Transfer:
    """Stream ``retained`` to the receiver on ``channel`` (named ``name``) and commit it.

    A subscriber that already holds the version is sent nothing; one that holds a newer
    version gets it as a rebase (a fetch of an older version, which its limits must allow).
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
        sent = 0
        for seq, bucket in enumerate(retained.buckets, start=1):
            while link.session.in_flight >= window:
                await _acked(link, version)
            if manifest is None:
                message = Bucket(version, seq, seq - 1, bucket.used, specs=bucket.specs)
            else:
                message = Bucket(version, seq, seq - 1, bucket.used, slots=bucket.slots)
            await link.send(encode(message), f"bucket {seq}", version)
            link.session.sent(seq)
            sent += bucket.used
        while link.session.in_flight:
            await _acked(link, version)
        count = len(retained.buckets)
        complete = Complete(version, count + 1, count, retained.tensors)
        await link.request(encode(complete), count + 1, "completion check", version)
        await link.request(encode(Commit(version, count + 2)), count + 2, "commit", version)
        link.session.committed()
        return Transfer(version, sent, count)
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
