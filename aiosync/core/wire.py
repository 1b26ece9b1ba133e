"""Typed wire messages and their codec: msgpack through msgspec, never Python objects.

Every message is a tagged :class:`msgspec.Struct`; :func:`decode` turns bytes into exactly one
of them or raises :class:`~aiosync.core.errors.ProtocolError`. Order is checked by the session
machines (:mod:`aiosync.core.engine_session`, :mod:`aiosync.core.trainer_session`).

One version, as seen by one engine::

    Hello(protocol range, data plane)  ->  Ready(protocol, version)     once per session
    Begin(version, manifest)           ->  Ack(seq 0: accepted | refused)
    Bucket(version, seq 1..n)          ->  Ack(seq: applied | refused)
        (bucket 1 may ride in the begin, ``Begin.first``; the same two acks)
    Complete(version, seq n+1)         ->  Ack(prepared: whole and checked | refused)
    Commit(version, seq n+2, deadline) ->  Ack(committed | refused: past the deadline)

Sequence numbers count within a version, so every engine of a fleet gets the same bytes.
The data planes' specs a hello carries are in :mod:`aiosync.core.plane_specs` (named here too).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import Limits
from aiosync.core.manifest import TensorMeta
from aiosync.core.plane_specs import CollectivePlaneSpec as CollectivePlaneSpec
from aiosync.core.plane_specs import CudaLegacyPlaneSpec as CudaLegacyPlaneSpec
from aiosync.core.plane_specs import CudaPlaneSpec as CudaPlaneSpec
from aiosync.core.plane_specs import CudaRegion as CudaRegion
from aiosync.core.plane_specs import DirectPlaneSpec as DirectPlaneSpec
from aiosync.core.plane_specs import GatheredPlaneSpec as GatheredPlaneSpec
from aiosync.core.plane_specs import PlaneSpec as PlaneSpec
from aiosync.core.plane_specs import Region as Region
from aiosync.core.plane_specs import ShmHandle as ShmHandle
from aiosync.core.plane_specs import ShmPlaneSpec as ShmPlaneSpec

PROTOCOL = 6
"""The one protocol version this build speaks (bumped when a message changes shape).

6: the CUDA plane's tag ``cuda`` (was ``cuda_legacy``; ``cuda_ipc`` is gone) and a colocated
part naming its buffer as a region, so a peer of the build before is refused at the hello,
naming both versions, rather than by an unknown plane tag.

Both ends ship together, so no older version is kept. The hello still states a range
(``protocol_min``..``protocol_max``), so that a peer of another build is refused with one
error naming both sides' versions (:func:`spoken`).
"""
PROTOCOL_MIN = PROTOCOL_MAX = PROTOCOL
"""The range this build states in its hello: :data:`PROTOCOL` alone."""


def spoken(low: int, high: int) -> str:
    """A stated range of protocol versions in words: ``"protocol 5"``, ``"protocols 2-4"``."""
    return f"protocol {low}" if low == high else f"protocols {low}-{high}"


class Hello(msgspec.Struct, frozen=True, tag="hello", omit_defaults=True):
    """Sender -> engine: opens a session, states the protocol range and the data plane.

    ``timeout`` (None: not stated): the longest the sender waits for an answer,
    which an engine names when it refuses a commit its leases held past the deadline.
    """

    protocol_min: int
    protocol_max: int
    session: str
    sender: str
    plane: PlaneSpec
    timeout: float | None = None


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Engine -> sender: the plane is open; ``protocol`` is the version both will speak.

    ``limits`` are the engine's bounds, which the sender plans its buckets to fit.
    ``events``: for a CUDA plane, the engine's IPC event per buffer, recorded once a
    bucket's copies are queued (the trainer's stream waits on it before reusing the buffer).
    ``swap_timeout`` (None: the engine never waits to make a version live, as with an
    in-place sink): the longest a commit may wait for read leases before the engine
    answers it; ``ack_at``: ``"live"`` or ``"staged"``, when that answer goes (None: not
    stated).
    """

    session: str
    protocol: int
    version: int | None
    limits: Limits = Limits()
    events: list[bytes] = []
    swap_timeout: float | None = None
    ack_at: str | None = None


class Begin(msgspec.Struct, frozen=True, tag="begin"):
    """Sender -> engine: opens the stream of ``version`` (seq 0), with its manifest if known.

    ``empty``: the sender means to send no tensor at all (refused unless said). ``rebase``:
    the sender restarts the numbering (a trainer back from a checkpoint); the engine takes
    it only if its limits allow. ``first``: the version's bucket 1 in the same
    message, taken exactly as if it followed the begin (a direct bucket sent before the
    trainer's read: one message for the engine to wake for and decode, not two).
    """

    version: int
    manifest: list[TensorMeta] | None = None
    empty: bool = False
    rebase: bool = False
    first: Bucket | None = None


def split_begin(begin: Begin) -> tuple[Begin, Bucket | None]:
    """``begin`` without the bucket 1 it carries (``first``), and that bucket (or None)."""
    if begin.first is None:
        return begin, None
    return msgspec.structs.replace(begin, first=None), begin.first


class Slot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where manifest entry ``entry``'s bytes (or one range of them) lie in a bucket."""

    entry: int
    offset: int
    nbytes: int
    start: int = 0


class Bucket(msgspec.Struct, frozen=True, tag="bucket"):
    """Sender -> engine: buffer ``buffer`` holds ``used`` bytes of ``version``.

    With a manifest, ``slots`` refer to its entries; without one, ``specs`` name each tensor.
    ``regions`` (direct mode, buffer past the ring): the trainer memory the offsets run
    through, in order. ``digest``: the SHA-256 of the bucket's bytes (the engine may keep
    them by it, to resume an interrupted version); ``held``: the engine holds these bytes
    already (it said so), so it reads them from its own store, not from ``buffer``.
    ``after`` (a CUDA plane with a ``counter``): the bucket was sent before the
    trainer packed it; its reads wait until the trainer's counter reaches this value.
    """

    version: int
    seq: int
    buffer: int
    used: int
    slots: list[Slot] = []
    specs: list[TensorSpec] = []
    regions: list[Region] = []
    digest: bytes | None = None
    held: bool = False
    after: int | None = None


class Complete(msgspec.Struct, frozen=True, tag="complete"):
    """Sender -> engine: ``version`` went out whole; prepare it (check it, do not commit)."""

    version: int
    seq: int
    buckets: int
    tensors: int


class Commit(msgspec.Struct, frozen=True, tag="commit", omit_defaults=True):
    """Sender -> engine: every required engine prepared ``version``; make it current.

    ``deadline``: when the sender stops waiting for the answer, in seconds
    since the epoch (``time.time()``, a clock both ends share: one host for ``ipc://``,
    synchronised hosts for ``tcp://``). An engine refuses to make the version live past
    it, so a sender that gave up never leaves an engine that commits later (None: no
    deadline; every aiosync sender states one).
    """

    version: int
    seq: int
    deadline: float | None = None


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """Engine -> sender: the outcome of message ``seq`` of ``version``.

    ``error`` is set when ``ok`` is false; ``busy`` marks a refusal that a retry may clear.
    """

    version: int | None
    seq: int
    ok: bool
    error: str | None = None
    tensor: str | None = None
    busy: bool = False


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Either way: the stream of ``version`` (or the session, when None) is abandoned.

    ``withdrawn`` (sender -> engine): a ``begin`` sent before the trainer read its tensors
    is taken back (the read showed another version, or failed); an engine that received
    nothing after that ``begin`` records no failure for it.
    """

    reason: str
    version: int | None = None
    withdrawn: bool = False


GOODBYE_SEQ = -1
"""Sequence number of the ack that answers a goodbye."""


class Goodbye(msgspec.Struct, frozen=True, tag="goodbye"):
    """Sender -> engine: the session ends; its buffers may be released. Answered by an ack."""

    session: str


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Sender -> engine: the session is alive (sent while idle); never answered."""

    session: str


class Challenge(msgspec.Struct, frozen=True, tag="challenge"):
    """Server -> engine, outside any session: the secret of subscription ``ref``; never answered.

    A weight server sends it through the channel it opens to the receiver a subscription
    names; the engine's own subscriber reads it in-process and presents it on its control
    channel, which proves the receiver is its own (:mod:`aiosync.engine.challenges`).
    """

    ref: str
    token: bytes


Message = (
    Hello | Ready | Begin | Bucket | Complete | Commit | Ack | Abort | Goodbye | Ping | Challenge
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Serialise one message to msgpack bytes."""
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> Message:
    """Parse bytes into one message; :class:`ProtocolError` if malformed, truncated or unknown."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable message ({len(data)} bytes): {exc}") from None


_NIL = msgspec.Raw(b"\xc0")  # msgpack's nil


class _BeginBytes(msgspec.Struct, frozen=True, tag="begin"):
    """A :class:`Begin` whose manifest is left as msgpack bytes (same fields, same wire)."""

    version: int
    manifest: msgspec.Raw = _NIL  # any value, nil included (msgspec takes no Raw in a union)
    empty: bool = False
    rebase: bool = False
    first: Bucket | None = None


_Lazy = Hello | Ready | _BeginBytes | Bucket | Complete | Commit | Ack | Abort | Goodbye | Ping
_lazy_decoder = msgspec.msgpack.Decoder(_Lazy | Challenge)
_manifest_decoder = msgspec.msgpack.Decoder(list[TensorMeta])


class ManifestMemo:
    """:func:`decode` that keeps the last accepted ``begin``'s manifest, by its bytes.

    A trainer sends the same manifest every version; an engine that finds the same bytes
    again takes the list it decoded then (the very object, which its stream memory
    recognises without comparing entries) instead of decoding hundreds of entries. Only a
    manifest the engine accepted is kept (:meth:`settle`), so a peer cannot make it hold
    more than its limits allow; one is kept (held, never changed). Use from one thread at
    a time. A field named twice in one message counts with its last value, as in
    :func:`decode`, which also type-checks the earlier one.
    """

    def __init__(self) -> None:
        self._last: tuple[bytes, list[TensorMeta]] | None = None
        self._pending: tuple[bytes, list[TensorMeta]] | None = None

    def decode(self, data: bytes | memoryview) -> Message:
        """As :func:`decode`; a ``begin`` with the last manifest's bytes reuses its list."""
        self._pending = None  # :meth:`settle` speaks of the message decoded last
        try:
            message: Message | _BeginBytes = _lazy_decoder.decode(data)
            if not isinstance(message, _BeginBytes):
                return message
            raw = bytes(message.manifest)
            manifest = None if raw == bytes(_NIL) else self._manifest(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ProtocolError(f"undecodable message ({len(data)} bytes): {exc}") from None
        return Begin(message.version, manifest, message.empty, message.rebase, message.first)

    def settle(
        self, accepted: list[TensorMeta] | None, held: list[TensorMeta] | None = None
    ) -> None:
        """The message last decoded, a ``begin``, was decided: keep its manifest if ``accepted``.

        (None: refused, or no manifest; what was decoded for it is let go.) ``held``: the
        equal list the engine's stream holds instead (its stream memory's), kept in its place.
        """
        pending, self._pending = self._pending, None
        if pending is not None and accepted is pending[1]:
            self._last = (pending[0], accepted if held is None else held)

    def keep_only(self, held: Iterable[object]) -> None:
        """Let the kept manifest go unless it is one of ``held`` (the very list).

        An engine passes what its open streams and its stream memory hold, so a manifest
        no stream holds any more, such as an abandoned begin's, is not kept either.
        """
        last = self._last
        if last is not None and not any(manifest is last[1] for manifest in held):
            self._last = None

    @property
    def kept(self) -> tuple[int, list[TensorMeta] | None]:
        """The kept manifest's encoded bytes and its list (0 and None: none is kept)."""
        return (0, None) if self._last is None else (len(self._last[0]), self._last[1])

    def _manifest(self, data: bytes) -> list[TensorMeta]:
        last = self._last
        if last is not None and last[0] == data:
            return last[1]
        manifest: list[TensorMeta] = _manifest_decoder.decode(data)
        self._pending = (data, manifest)
        return manifest
