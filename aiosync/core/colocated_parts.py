"""What one trainer rank says about its share of a bucket, and its msgpack codec (pure).

A :class:`RankPart` names the buffer holding the rank's packed bucket (a shared-memory
segment on the CPU, a ``cudaMalloc`` allocation's legacy IPC handle on a GPU: the buffers of
:mod:`aiosync.planes`) and where each tensor lies in it. Parts travel as msgpack bytes:
gathered to the engine's source rank in a ``uint8`` tensor, then handed to the engine. Never
pickle: whoever decodes one treats it as hostile, and :func:`decode_part` returns a checked
part or raises :class:`~aiosync.core.errors.ProtocolError`.
"""

from __future__ import annotations

import msgspec

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import TensorSpec, validate_specs
from aiosync.core.wire import CudaRegion, ShmHandle

MAX_PART_BYTES = 64 * 1024 * 1024
"""Most bytes one encoded part may have (a part lists specs, never tensor data)."""

MAX_ERROR_CHARS = 4096
"""Characters of a rank's error text kept."""

FORMAT = "aiosync_colocated"
"""The ``load_format`` under which an engine is handed encoded parts."""


class RankPart(msgspec.Struct, frozen=True, tag="colocated_part"):
    """Trainer rank ``rank``'s share of bucket ``seq`` of one sync, for engine ``engine``.

    ``buffer`` holds ``used`` bytes laid out as ``specs`` say. A part marked ``last`` ends
    the sync and names no buffer and no tensor: without ``commit`` the engine prepares the
    version (checks it is whole, changes nothing visible); with ``commit``, sent once every
    engine prepared, it makes the prepared version current.
    ``error`` says why this rank could not pack its share (the bucket then fails on every
    rank instead of leaving the others waiting in a collective).
    """

    rank: int
    engine: int
    seq: int
    last: bool = False
    commit: bool = False
    buffer: ShmHandle | CudaRegion | None = None
    used: int = 0
    specs: list[TensorSpec] = []
    error: str | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankPart)


def encode_part(part: RankPart) -> bytes:
    """The part as msgpack bytes."""
    return _encoder.encode(part)


def decode_part(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_PART_BYTES
) -> RankPart:
    """Parse and check one part; :class:`ProtocolError` naming what is wrong.

    Checks: the size bound, the schema, non-negative numbers, ``used`` within the buffer,
    and the specs (aligned, ascending, each inside the bucket and its tensor).
    """
    if len(data) > max_bytes:
        raise ProtocolError(f"a bucket description of {len(data)} bytes is over {max_bytes}")
    try:
        part = _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable bucket description ({len(data)} bytes): {exc}") from None
    capacity = 0 if part.buffer is None else part.buffer.size
    if min(part.rank, part.engine, part.seq, part.used, capacity) < 0:
        raise ProtocolError(f"bucket description from rank {part.rank} has a negative field")
    if part.last and (part.specs or part.buffer is not None):
        raise ProtocolError(f"rank {part.rank}: a part ending the sync carries tensors")
    if part.commit and not part.last:
        raise ProtocolError(f"rank {part.rank}: a commit in the middle of a sync")
    if part.error is not None and len(part.error) > MAX_ERROR_CHARS:
        part = msgspec.structs.replace(part, error=part.error[:MAX_ERROR_CHARS] + "...")
    try:
        validate_specs(part.specs, part.used, capacity)
    except ProtocolError as exc:
        raise ProtocolError(f"rank {part.rank}: {exc.reason}", tensor=exc.tensor) from None
    return part


def check_parts(parts: list[RankPart], *, engine: int, ranks: list[int], seq: int) -> bool:
    """Check that ``parts`` are one bucket of ``engine`` from ``ranks`` in order.

    Returns whether the parts end the sync (every part must agree, and on whether they
    commit); raises
    :class:`ProtocolError` naming the first rank whose part does not fit.
    """
    if len(parts) != len(ranks):
        raise ProtocolError(f"engine {engine}: {len(parts)} parts for {len(ranks)} ranks")
    for part, rank in zip(parts, ranks, strict=True):
        if part.rank != rank or part.engine != engine or part.seq != seq:
            raise ProtocolError(
                f"engine {engine}: expected bucket {seq} of rank {rank}, got bucket "
                f"{part.seq} of rank {part.rank} for engine {part.engine}"
            )
    if len({(part.last, part.commit) for part in parts}) != 1:
        ended = [part.rank for part in parts if part.last]
        raise ProtocolError(
            f"engine {engine}: ranks {ended} ended the sync at bucket {seq} but others did not"
        )
    return parts[0].last
