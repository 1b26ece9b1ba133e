"""What a receiver was told by servers' challenges, for its own subscriber to read in-process.

A weight server proves that a subscription's receiver belongs to the subscriber: it sends
a random token (a :class:`~aiosync.core.wire.Challenge`) through the channel it opens to
the receiver the subscription names, and feeds it only once the subscriber presents that
token on its control channel. The receiver never answers a challenge and never sends a
token anywhere; only code in its own process reads them, here. A client that named
another engine's receiver never learns the token, so nothing is fed.

Challenges are peer input: whoever reaches the receiver may send some. At most
:data:`KEPT` are kept (the oldest go first), each ``ref`` and token bounded; the first
token for a ``ref`` is the one kept.
"""

from __future__ import annotations

from collections import OrderedDict

import anyio

from aiosync.core.errors import SyncTimeoutError

KEPT = 16
"""Challenges a receiver keeps at once (more evict the oldest)."""

MAX_REF = 64
"""Characters of a challenge's ``ref`` (longer ones are ignored)."""

MAX_TOKEN = 64
"""Bytes of a challenge's token (longer ones are ignored)."""


class Challenges:
    """The last :data:`KEPT` challenges a receiver was sent, by ``ref``."""

    def __init__(self) -> None:
        self._tokens: OrderedDict[str, bytes] = OrderedDict()
        self._changed = anyio.Event()

    def note(self, ref: str, token: bytes) -> None:
        """Keep ``token`` for ``ref`` (a ``ref`` seen already keeps its first token)."""
        if not ref or len(ref) > MAX_REF or not token or len(token) > MAX_TOKEN:
            return
        if ref in self._tokens:
            return
        self._tokens[ref] = bytes(token)
        while len(self._tokens) > KEPT:
            self._tokens.popitem(last=False)
        self._changed.set()
        self._changed = anyio.Event()

    def __len__(self) -> int:
        """Challenges kept now."""
        return len(self._tokens)

    def token(self, ref: str) -> bytes | None:
        """The token sent for ``ref``, if it arrived (and is still kept)."""
        return self._tokens.get(ref)

    async def wait(self, ref: str, timeout: float, *, endpoint: str = "") -> bytes:
        """The token for ``ref`` once it arrives; :class:`SyncTimeoutError` after ``timeout``."""
        with anyio.move_on_after(timeout):
            while (token := self._tokens.get(ref)) is None:
                await self._changed.wait()
            return token
        raise SyncTimeoutError(
            f"the server's challenge {ref!r} did not reach this engine's receiver within "
            f"{timeout:g}s: the server could not reach it (on tcp://, the receiver must "
            "allow the server's public key)",
            peer=endpoint or None,
        )
