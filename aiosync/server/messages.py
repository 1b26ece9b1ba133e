"""The server's control messages (msgpack through msgspec, never Python objects).

Subscribers and clients talk to a server's *control* endpoint with these; weights never
travel here. Versions reach a subscriber as an ordinary weight stream
(:mod:`aiosync.core.wire`) from the server to the subscriber's receiver.

=============  ==========  ==========================================================
message        direction   meaning
=============  ==========  ==========================================================
``subscribe``  C -> S      send versions to the receiver at ``endpoint``; may lag ``max_lag``;
                           (resuming) the buckets it holds already, by digest
``prove``      S -> C      a challenge ``ref`` went to that receiver: show its token
``proof``      C -> S      the token the receiver was sent: the subscription goes ahead
``fetch``      C -> S      send this retained version and stay on it (stop following)
``follow``     C -> S      follow the newest version again
``status?``    C -> S      report versions and engines now
``wait``       C -> S      answer once engines are within bounds / have a version
``status``     S -> C      the answer: newest, retained, each engine's version and lag
``refused``    S -> C      a request refused, with the reason
``closing``    S -> C      the server is shutting down
``pull``       R -> S      (a relay) the newest version newer than mine, as a ``head``
``get``        R -> S      (a relay) a range of one bucket's bytes, answered by a ``chunk``
``head``       S -> R      a version's buckets: bytes used, content digest, specs
``chunk``      S -> R      a range of a bucket's bytes, in a second message part
=============  ==========  ==========================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import TensorSpec
from aiosync.engine.held import DIGEST_BYTES

if TYPE_CHECKING:
    from aiosync.server.fleet import SubscriberState


class Subscribe(msgspec.Struct, frozen=True, tag="subscribe"):
    """Send versions to the receiver at ``endpoint`` (it may lag ``max_lag`` versions).

    ``key``: the receiver's public CURVE key (Z85), for a ``tcp://`` endpoint with keys.
    ``resume``: name every bucket by its digest (the engine keeps the buckets of a version
    until it commits); ``held``: digests of buckets the engine holds already (from a
    version it did not finish, ``held_version``), which the server then does not send.
    The server reads at most :data:`MAX_HELD` of them; a malformed or unknown digest is
    simply not held.
    """

    name: str
    endpoint: str
    max_lag: int = 0
    follow: bool = True
    key: str | None = None
    resume: bool = False
    held: list[bytes] = []
    held_version: int | None = None


class Prove(msgspec.Struct, frozen=True, tag="prove"):
    """Server -> subscriber: challenge ``ref`` went to the receiver named; send its token.

    The server feeds the receiver only once the same control channel sends a
    :class:`Proof` holding the token it sent there (:mod:`aiosync.server.admission`).
    """

    ref: str


class Proof(msgspec.Struct, frozen=True, tag="proof"):
    """Subscriber -> server: the token its receiver was sent (it owns that receiver)."""

    token: bytes


class Fetch(msgspec.Struct, frozen=True, tag="fetch"):
    """Send the retained ``version`` and keep the subscriber on it."""

    version: int


class Follow(msgspec.Struct, frozen=True, tag="follow"):
    """Follow the newest version again."""


class StatusRequest(msgspec.Struct, frozen=True, tag="status?"):
    """Ask for a :class:`Status`."""


class Wait(msgspec.Struct, frozen=True, tag="wait"):
    """Answer (a :class:`Status`) once the condition holds, or ``refused`` after ``timeout``.

    With ``version``: once every engine in ``engines`` (default: all) holds it or newer;
    without: once every engine is within its lag bound.
    """

    timeout: float
    version: int | None = None
    engines: list[str] | None = None


class EngineStatus(msgspec.Struct, frozen=True, array_like=True):
    """One subscriber as the server sees it; bytes of its buckets sent, and those it held."""

    name: str
    version: int | None
    max_lag: int
    lag: int | None
    connected: bool
    bytes_sent: int = 0
    bytes_held: int = 0


def engine_status(state: SubscriberState, lag: int | None) -> EngineStatus:
    """What the server reports of one subscriber."""
    s = state
    return EngineStatus(s.name, s.version, s.max_lag, lag, s.connected, s.bytes_sent, s.bytes_held)


class Status(msgspec.Struct, frozen=True, tag="status"):
    """The server now: newest and retained versions, and every engine."""

    newest: int | None
    retained: list[int]
    engines: list[EngineStatus]


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """A request the server will not carry out."""

    reason: str


class Closing(msgspec.Struct, frozen=True, tag="closing"):
    """The server is shutting down."""

    reason: str


class Pull(msgspec.Struct, frozen=True, tag="pull"):
    """Relay -> server: the newest retained version newer than ``have``, as a :class:`Head`.

    Waits at most ``timeout`` seconds for one (then ``refused``). The version stays pinned
    for this channel until its next pull or until the channel ends.
    """

    have: int | None
    timeout: float


class Get(msgspec.Struct, frozen=True, tag="get"):
    """Relay -> server: bytes ``[offset, offset + nbytes)`` of a bucket of the pulled version.

    Answered by one :class:`Chunk`; at most :data:`MAX_CHUNK_BYTES` per get.
    """

    version: int
    bucket: int
    offset: int
    nbytes: int


class BucketHead(msgspec.Struct, frozen=True, array_like=True):
    """One retained bucket: bytes used, content digest (SHA-256) and specs."""

    used: int
    digest: bytes
    specs: list[TensorSpec]


class Head(msgspec.Struct, frozen=True, tag="head"):
    """Server -> relay: a retained version's buckets, each identified by its content."""

    version: int
    buckets: list[BucketHead]


class Chunk(msgspec.Struct, frozen=True, tag="chunk"):
    """Server -> relay: bytes ``[offset, offset + nbytes)`` of a bucket follow this header.

    The bytes travel as the message's second part, sent from the retained segment and
    received into the relay's without being copied into or out of any message.
    """

    version: int
    bucket: int
    offset: int
    nbytes: int


Request = Subscribe | Proof | Fetch | Follow | StatusRequest | Wait | Pull | Get
Reply = Status | Refused | Closing | Head | Chunk | Prove
ControlMessage = Request | Reply

MAX_CONTROL_BYTES = 1 << 20
"""Largest request a server accepts (and reply a client accepts, unless it says more)."""

CHUNK_BYTES = 16 << 20
"""Bucket bytes a relay asks for in one :class:`Get` (fewer in a bucket's last chunk)."""

MAX_CHUNK_BYTES = 64 << 20
"""The most bytes a server sends for one :class:`Get`."""

MAX_HELD = 1 << 14
"""Digests of held buckets a server reads from one subscription (the rest are not held)."""

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def health(status: Status) -> tuple[bool, dict[str, Any]]:
    """(ready, JSON-able detail) of a server's status: ready once a version is retained."""
    detail = {
        "ready": status.newest is not None,
        "newest": status.newest,
        "retained": status.retained,
        "engines": {e.name: {"version": e.version, "lag": e.lag} for e in status.engines},
    }
    return status.newest is not None, detail


def held_digests(digests: list[bytes]) -> frozenset[bytes]:
    """A subscriber's claimed digests (peer input): at most :data:`MAX_HELD`, each 32 bytes."""
    return frozenset(d for d in digests[:MAX_HELD] if len(d) == DIGEST_BYTES)


def bounded_wait(seconds: float, most: float) -> float:
    """A peer's wait in seconds, clamped to ``[0, most]`` (NaN counts as 0)."""
    if not seconds > 0:  # also NaN
        return 0.0
    return min(seconds, most)


def encode(message: ControlMessage) -> bytes:
    """One control message as msgpack bytes."""
    return _encoder.encode(message)


def _check(data: bytes | memoryview, limit: int = MAX_CONTROL_BYTES) -> None:
    if len(data) > limit:
        raise ProtocolError(f"{len(data)}-byte control message (most {limit})")


def _undecodable(data: bytes | memoryview, exc: Exception) -> ProtocolError:
    return ProtocolError(f"undecodable control message ({len(data)} bytes): {exc}")


def decode_request(data: bytes) -> Request:
    """A client's request; :class:`ProtocolError` if malformed or too large."""
    _check(data)
    try:
        return _requests.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _undecodable(data, exc) from None


def decode_reply(data: bytes | memoryview, limit: int = MAX_CONTROL_BYTES) -> Reply:
    """A server's reply; :class:`ProtocolError` if malformed or over ``limit`` bytes."""
    _check(data, limit)
    try:
        return _replies.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _undecodable(data, exc) from None
