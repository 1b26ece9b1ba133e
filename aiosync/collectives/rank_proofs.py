"""Proofs that each rank of a side group is who the trainer greeted (pure logic, no IO).

The trainer gives every engine session a fresh random secret inside its hello, over
aiosync's authenticated control channel; the secret never goes into the rendezvous store.
Once the group has formed, and before any weight is broadcast, every engine rank offers a
row (:func:`engine_row`): an id of its secret and a keyed hash of the group, its token and
the rank. The trainer judges the rows (:func:`judge`): a rank whose id names no secret it
handed out, whose hash is wrong, or whose secret another rank already proved, is refused.
It answers with a verdict (:func:`encode_verdict`) holding, for each admitted rank, a keyed
hash only the holder of that rank's secret can check, so an engine also knows that rank 0
is the trainer that greeted it (:func:`read_verdict`). Every hash is bound to the group's
name, its token and the rank, so none is worth anything in another group or at another
rank.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets as random
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from aiosync.core.errors import ProtocolError

SECRET_BYTES = 32
SECRET_HEX = 2 * SECRET_BYTES
KEY_ID_BYTES = 16
PROOF_BYTES = 32
ROW_BYTES = KEY_ID_BYTES + PROOF_BYTES
"""What each rank contributes to the gather (rank 0's row is zeros)."""
_HEADER = struct.Struct(">4sI")  # status, the first refused rank
_ADMITTED, _REFUSED = b"okay", b"nope"


def new_secret() -> str:
    """A fresh random secret for one engine session (hex, 256 bits)."""
    return random.token_hex(SECRET_BYTES)


def is_secret(value: str) -> bool:
    """True when ``value`` looks like a secret from :func:`new_secret` (checks hostile input)."""
    return len(value) == SECRET_HEX and all(c in "0123456789abcdef" for c in value)


def key_id(secret: str) -> bytes:
    """The public name of ``secret`` in a row (a hash: it says nothing of the secret)."""
    return hashlib.sha256(b"aiosync-rank-key\0" + bytes.fromhex(secret)).digest()[:KEY_ID_BYTES]


def _mac(secret: str, role: bytes, group: str, token: str, rank: int) -> bytes:
    message = b"\0".join((b"aiosync-" + role, group.encode(), token.encode(), b"%d" % rank))
    return hmac.new(bytes.fromhex(secret), message, hashlib.sha256).digest()


def engine_row(secret: str, group: str, token: str, rank: int) -> bytes:
    """Rank ``rank``'s row: its secret's id, then its keyed hash of the group and rank."""
    return key_id(secret) + _mac(secret, b"engine", group, token, rank)


def verdict_bytes(world_size: int) -> int:
    """The size of a verdict for a group of ``world_size`` ranks."""
    return _HEADER.size + world_size * PROOF_BYTES


@dataclass(frozen=True)
class Admission:
    """The trainer's judgement of a group's engine ranks.

    ``proved``: each admitted rank and the secret it proved. ``refused``: the ranks that
    proved no secret the trainer handed out (or one another rank had proved already).
    """

    proved: dict[int, str]
    refused: tuple[int, ...]


def judge(rows: Sequence[bytes], issued: Collection[str], group: str, token: str) -> Admission:
    """Judge the engine ranks' rows (``rows[r]`` is rank ``r``'s; rank 0 is the trainer)."""
    by_id = {key_id(secret): secret for secret in issued}
    proved: dict[int, str] = {}
    refused: list[int] = []
    used: set[str] = set()
    for rank, row in enumerate(rows):
        if rank == 0:
            continue
        secret = by_id.get(bytes(row[:KEY_ID_BYTES])) if len(row) == ROW_BYTES else None
        expected = engine_row(secret, group, token, rank) if secret is not None else b""
        if secret is None or secret in used or not hmac.compare_digest(bytes(row), expected):
            refused.append(rank)
            continue
        used.add(secret)
        proved[rank] = secret
    return Admission(proved, tuple(refused))


def encode_verdict(admission: Admission, world_size: int, group: str, token: str) -> bytes:
    """The trainer's answer to every rank: admitted or not, and its proof to each rank."""
    first = admission.refused[0] if admission.refused else 0
    status = _REFUSED if admission.refused else _ADMITTED
    slots = bytearray(world_size * PROOF_BYTES)
    for rank, secret in admission.proved.items():
        at = rank * PROOF_BYTES
        slots[at : at + PROOF_BYTES] = _mac(secret, b"trainer", group, token, rank)
    return _HEADER.pack(status, first) + bytes(slots)


def read_verdict(data: bytes, secret: str, group: str, token: str, rank: int) -> None:
    """Check the verdict rank ``rank`` received; raises :class:`ProtocolError` unless admitted.

    The proof in its slot shows that rank 0 holds this rank's secret: the trainer that
    greeted this engine, not a process that took rank 0 in its place.
    """
    world = (len(data) - _HEADER.size) // PROOF_BYTES
    if len(data) != verdict_bytes(world) or not 0 < rank < world:
        raise ProtocolError(f"group {group}: a malformed admission verdict ({len(data)} bytes)")
    status, first = _HEADER.unpack_from(data)
    at = _HEADER.size + rank * PROOF_BYTES
    slot = data[at : at + PROOF_BYTES]
    if status == _REFUSED:
        raise ProtocolError(
            f"group {group}: the trainer refused the group before any broadcast, as rank "
            f"{first} proved no engine session's secret (a process that is not one of its "
            "engines took a rank)"
        )
    if status != _ADMITTED or not hmac.compare_digest(
        slot, _mac(secret, b"trainer", group, token, rank)
    ):
        raise ProtocolError(
            f"group {group}: rank 0 did not prove it is the trainer that greeted this engine "
            f"(rank {rank}); refusing its broadcasts"
        )


def refused_error(admission: Admission, group: str) -> ProtocolError:
    """The trainer's error for a group with refused ranks (names every one)."""
    ranks = ", ".join(str(rank) for rank in admission.refused)
    many = "s" if len(admission.refused) > 1 else ""
    return ProtocolError(
        f"group {group}: rank{many} {ranks} proved no engine session's secret (a process that "
        "is not one of this sender's engines took the rank); the group is refused before "
        "any weight is broadcast (open a new sender)"
    )
