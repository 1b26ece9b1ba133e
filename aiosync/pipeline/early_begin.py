"""A version's ``begin`` sent before its tensors are read, on the guess that its manifest holds.

An engine that sat idle between two versions takes 0.3-0.7 ms to wake for the ``begin``
on the shared GPU hosts, and 0.3-0.5 ms more to check it; a direct version then waits for
both before its first copy (docs/benchmarks.md). A trainer usually sends the same names,
dtypes and shapes every version, so the sender guesses that this version's manifest is the
last one's and sends that ``begin`` first: the engine wakes and checks it while the trainer
reads its tensors. If the read shows another manifest, or fails, the guess is withdrawn
(an ``abort`` of the version) and the version begins again as usual. A kept bucket 1
may have gone with the ``begin`` (see :func:`begin_early`): an engine then applied it
before the withdrawal, which it treats as any abort. In direct mode its copies wait on the
trainer's start event; a ring bucket is packed only after the read, so its message names
the value of the trainer's counter that the pack sets (the CUDA plane's ``arm``), and a
withdrawal sets it too (``release``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio

from aiosync.core.errors import AiosyncError
from aiosync.core.layout import BucketPlan
from aiosync.core.manifest import TensorMeta
from aiosync.core.wire import Abort, encode
from aiosync.pipeline.begin import encode_begin
from aiosync.pipeline.fanout import kept_first_payload
from aiosync.pipeline.links import EngineLink

log = logging.getLogger(__name__)

WITHDRAW_TIMEOUT = 1.0
"""Seconds each engine's ``abort`` of a withdrawn guess may take to send (best effort)."""


class EarlyBegin:
    """The ``begin`` of ``version`` with a guessed ``manifest``, sent to every one of ``links``.

    Each link's stream is open with the ``begin`` awaiting its ack, exactly as if the
    pipeline had sent it (:class:`~aiosync.pipeline.stream.StreamRun` takes it from there
    with ``begun=``), until :meth:`withdraw`. With a ``first`` plan (a bucket kept from the
    last version), bucket 1 went with the begin too; ``first_payload`` is its message as
    the fanout makes it once the version is read (``sent_first=``, to confirm). ``release``
    runs on a withdrawal (the plane sets a counter that the bucket's reads wait for).
    """

    def __init__(
        self,
        version: int,
        manifest: list[TensorMeta],
        payload: bytes,
        links: list[EngineLink],
        first: BucketPlan | None = None,
        first_payload: bytes | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.version = version
        self.manifest = manifest
        self.payload = payload
        self.links = links
        self.first = first
        self.first_payload = first_payload
        self.release = release

    def holds(self, manifest: list[TensorMeta] | None, first: BucketPlan | None) -> bool:
        """Whether the version read is the guess.

        Its manifest (the same list, or equal) and, if bucket 1 went too, the very plan it
        was made from, or (a layout kept and rebuilt) one with the same list of specs.
        """
        if manifest is not self.manifest and manifest != self.manifest:
            return False
        kept = self.first
        if kept is None or first is kept:
            return True
        return first is not None and first.specs is kept.specs and first.used == kept.used

    async def withdraw(self, reason: str) -> None:
        """Tell each engine to drop the stream; never raises.

        Unrecorded by the engine where only the begin went; after bucket 1 it is an abort
        like any other (an in-place engine is then not servable until the next version).
        Each link's session skips the acks still due, so the version may begin again on
        the same links.
        """
        message = encode(Abort(reason, self.version, withdrawn=True))
        if self.release is not None:
            try:
                self.release()
            except Exception:  # the engines still drop the stream; log why
                log.exception("could not release bucket 1 of version %d", self.version)
        with anyio.CancelScope(shield=True):
            for link in self.links:
                link.session.failed()
                with anyio.move_on_after(WITHDRAW_TIMEOUT):
                    try:
                        await link.channel.send(message)
                    except Exception as exc:  # the engine may be gone: it drops the stream
                        log.info("could not withdraw the begin from %s: %s", link.name, exc)


async def begin_early(
    links: Sequence[EngineLink],
    version: int,
    guess: list[TensorMeta],
    first: BucketPlan | None = None,
    after: int | None = None,
    release: Callable[[], None] | None = None,
) -> EarlyBegin | None:
    """Send ``version``'s ``begin`` with manifest ``guess`` to every link, or to none.

    With ``first`` (a direct plan the last version's split made, kept; or, with ``after``,
    the first ring plan of the layout kept from the last version), bucket 1 goes with each
    ``begin``: inside its message (one message to wake for and decode), or right after it
    where the two are too large together for an engine's message limit. The engines then
    start copying while the trainer checks its tensors (a ring bucket's copies wait until
    the plane's pack sets its counter to ``after``). ``release`` runs if the guess is
    withdrawn.
    None where nothing can go now: an engine would not take the manifest whole (the
    version then goes without one), an engine is not behind ``version``, a link is a REQ
    socket (one message at a time), or a send failed (the ones that went are withdrawn).
    """
    limits = [link.session.limits for link in links]
    for link in links:
        remote = link.session.remote_version
        if link.window is not None or (remote is not None and version <= remote):
            return None
    flags = {"empty": False, "rebase": False}
    bucket = None if first is None else kept_first_payload(version, first, after)
    as_read = bucket  # what the fanout makes once read: the same but for ``after``
    if first is not None and after is not None:
        as_read = kept_first_payload(version, first, after, as_read=True)
    inside = bucket
    payload, carried = encode_begin(version, guess, flags, limits, inside)
    if carried is None and inside is not None:  # too large together: two messages
        inside = None
        payload, carried = encode_begin(version, guess, flags, limits)
    if carried is None:
        return None
    early = EarlyBegin(version, guess, payload, [], first if bucket else None, as_read, release)
    try:
        for link in links:
            link.session.begin(version)
            early.links.append(link)
            await link.send(payload, "the begin", version)
            link.session.sent(0)
            if bucket is not None:
                if inside is None:
                    await link.send(bucket, "bucket 1", version)
                link.session.sent(1)
    except AiosyncError as exc:
        log.info("begin of version %d not sent early: %s", version, exc)
        await early.withdraw("the begin could not reach every engine")
        return None
    except BaseException:
        await early.withdraw("the trainer stopped")
        raise
    return early
