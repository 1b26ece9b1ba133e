"""Typed wire messages and their codec: msgpack through msgspec, never Python objects.

Every message is a tagged :class:`msgspec.Struct`; :func:`decode` turns bytes into exactly one
of them or raises :class:`~aiosync.errors.ProtocolError`. Message order is checked elsewhere,
by the state machines in :mod:`aiosync.protocol`.
"""

from __future__ import annotations

import msgspec

from aiosync.errors import ProtocolError
from aiosync.layout import TensorSpec

PROTOCOL_VERSION = 1
"""Bumped whenever a message changes shape; both sides must agree exactly."""


class ShmHandle(msgspec.Struct, frozen=True, tag="shm"):
    """A POSIX shared-memory segment of ``size`` bytes, opened by ``name``."""

    name: str
    size: int


class CudaIpcHandle(msgspec.Struct, frozen=True, tag="cuda"):
    """A CUDA allocation exported for IPC: the plain-data fields of a torch storage handle."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    size: int


BufferHandle = ShmHandle | CudaIpcHandle


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Sender -> receiver: opens a session and lists the buffers buckets will name."""

    protocol: int
    session: str
    sender: str
    buffers: list[BufferHandle]


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Receiver -> sender: buffers are mapped; ``version`` is the receiver's current one."""

    session: str
    version: int | None


class Bucket(msgspec.Struct, frozen=True, tag="bucket"):
    """Sender -> receiver: buffer ``buffer`` holds ``used`` bytes laid out as ``specs``."""

    seq: int
    version: int
    buffer: int
    used: int
    specs: list[TensorSpec]


class Complete(msgspec.Struct, frozen=True, tag="complete"):
    """Sender -> receiver: ``version`` went out whole, in ``buckets`` buckets of ``tensors``."""

    seq: int
    version: int
    buckets: int
    tensors: int


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """Receiver -> sender: the outcome of message ``seq``; ``error`` is set when ``ok`` is false."""

    seq: int
    ok: bool
    error: str | None = None
    tensor: str | None = None


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Either way: the stream of ``version`` (or the session, when None) is abandoned."""

    reason: str
    version: int | None = None


GOODBYE_SEQ = -1
"""Sequence number of the ack that answers a goodbye."""


class Goodbye(msgspec.Struct, frozen=True, tag="goodbye"):
    """Sender -> receiver: the session ends; its buffers may be released. Answered by an ack."""

    session: str


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Sender -> receiver: the session is alive (sent while idle); never answered."""

    session: str


Message = Hello | Ready | Bucket | Complete | Ack | Abort | Goodbye | Ping

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
