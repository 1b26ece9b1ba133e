"""A subscription's admission: reach the receiver it names, and prove the subscriber owns it.

The server opens its channel to the receiver a ``subscribe`` names and sends a
:class:`~aiosync.core.wire.Challenge` through it (a reference and a random token), then
answers the subscriber ``prove`` with the reference. Only code in the receiver's own
process can read the token (:mod:`aiosync.engine.challenges`): the subscriber must send
it back (``proof``) on the same control channel within the server's ``timeout``. Until
then the server feeds nothing and counts no subscriber; without the proof it closes its
channel to the receiver, which held no session for it and is left exactly as it was. So a
client naming another engine's receiver moves no version there.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

import aiosync.server.messages as m
from aiosync.channels.base import Channel
from aiosync.channels.keys import ChannelAuth
from aiosync.core.errors import AiosyncError, RejectedError
from aiosync.core.limits import shorten
from aiosync.core.wire import Challenge, encode
from aiosync.server.roles import new_challenge, proven, receiver_auth

log = logging.getLogger(__name__)

Replier = Callable[[Channel, m.Reply], Awaitable[None]]


async def admit(
    control: Channel,
    request: m.Subscribe,
    *,
    own: ChannelAuth | None,
    timeout: float,
    reply: Replier,
) -> Channel:
    """The channel to ``request``'s receiver, once the client on ``control`` proved it owns it.

    ``own`` is the server's ``subscriber_auth``; ``reply`` answers on ``control``. Raises
    :class:`RejectedError` saying why not (the channel to the receiver is then closed).
    """
    from aiosync.channels.zmq import ZmqChannel

    endpoint = shorten(request.endpoint, 64)
    try:
        auth = receiver_auth(request.endpoint, own, request.key)
        channel = ZmqChannel.connect(request.endpoint, auth=auth)
    except AiosyncError as exc:
        raise RejectedError(exc.reason, peer=control.peer) from None
    ref, token = new_challenge()
    try:
        problem: str | None = f"the subscription's proof did not arrive within {timeout:g}s"
        with anyio.move_on_after(timeout):
            await channel.send(encode(Challenge(ref, token)))
            await reply(control, m.Prove(ref))
            problem = await _proof(control, channel, token)
        if problem is None:
            return channel
        raise RejectedError(f"subscription to {endpoint} refused: {problem}", peer=control.peer)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await channel.aclose()
        raise


async def _proof(control: Channel, channel: Channel, token: bytes) -> str | None:
    """None once ``control`` sent the proof of ``token``; else what went wrong.

    Meanwhile the channel to the receiver is watched: a refused handshake or a receiver
    gone ends the wait at once (a receiver never answers a challenge: anything it sends is
    dropped).
    """
    outcome: list[str | None] = []
    async with anyio.create_task_group() as tg:

        async def proof() -> None:
            try:
                request = m.decode_request(await control.recv())
            except AiosyncError as exc:
                outcome.append(exc.reason)
            else:
                if proven(token, request):
                    outcome.append(None)
                elif isinstance(request, m.Proof):
                    outcome.append("its proof does not match the challenge sent to that receiver")
                else:
                    outcome.append(f"expected its proof, got {type(request).__name__.lower()}")
            tg.cancel_scope.cancel()

        async def reach() -> None:
            try:
                while True:
                    await channel.recv()
            except AiosyncError as exc:
                outcome.append(f"the server cannot reach that receiver: {exc.reason}")
                tg.cancel_scope.cancel()

        tg.start_soon(proof)
        tg.start_soon(reach)
    if outcome and outcome[0] is not None:
        log.warning("subscription from %s refused: %s", control.peer, outcome[0])
    return outcome[0] if outcome else "the subscription's proof did not arrive"
