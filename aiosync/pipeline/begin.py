"""The ``begin`` message of a version, its manifest encoded once while it stays the same."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from aiosync.core.limits import Limits
from aiosync.core.manifest import TensorMeta
from aiosync.core.where_to_run import on_loop
from aiosync.core.wire import Begin, encode

log = logging.getLogger(__name__)


class _RawBegin(msgspec.Struct, frozen=True, tag="begin"):
    """A :class:`~aiosync.core.wire.Begin` whose manifest is already msgpack: same bytes."""

    version: int
    manifest: msgspec.Raw | None = None
    empty: bool = False
    rebase: bool = False
    first: msgspec.Raw | None = None


class _ManifestBytes:
    """The last manifest encoded, by identity: a sender's unchanged layout reuses its list.

    (:class:`~aiosync.core.layout_memory.LayoutMemory` hands the same list out while the
    names, dtypes and shapes hold, so a hit costs no per-entry work.)
    """

    def __init__(self) -> None:
        self._last: tuple[list[TensorMeta], msgspec.Raw] | None = None

    def get(self, manifest: list[TensorMeta]) -> msgspec.Raw | None:
        last = self._last
        return last[1] if last is not None and last[0] is manifest else None

    def put(self, manifest: list[TensorMeta]) -> msgspec.Raw:
        raw = msgspec.Raw(msgspec.msgpack.encode(manifest))
        self._last = (manifest, raw)  # holding the list: its id is never reused meanwhile
        return raw


_MANIFESTS = _ManifestBytes()


def encode_begin(
    version: int,
    manifest: list[TensorMeta] | None,
    flags: dict[str, bool],
    limits: Sequence[Limits],
    first: bytes | None = None,
) -> tuple[bytes, list[TensorMeta] | None]:
    """The encoded ``begin`` and the manifest it carries (None past an engine's ``limits``).

    ``first``: bucket 1's encoded message, carried in the begin (``Begin.first``). The
    manifest's bytes are kept: the next version with the same manifest list reuses them.
    """
    raw = None
    if manifest is not None:
        raw = _MANIFESTS.get(manifest)
        if raw is None:
            raw = _MANIFESTS.put(manifest)
    bucket = None if first is None else msgspec.Raw(first)
    payload = msgspec.msgpack.encode(_RawBegin(version, raw, first=bucket, **flags))
    too_many = len(manifest or ()) > min(x.max_manifest_tensors for x in limits)
    if manifest is not None and (
        too_many or len(payload) > min(x.max_message_bytes for x in limits)
    ):
        log.info("version %d goes without a manifest (past an engine's limits)", version)
        return encode(Begin(version, None, flags["empty"], flags["rebase"])), None
    return payload, manifest


def begin_is_cheap(manifest: list[TensorMeta] | None) -> bool:
    """Whether encoding the ``begin`` is bounded work (then it runs on the loop).

    True for a small manifest, or one whose bytes are kept from the last version.
    """
    if not manifest or on_loop(entries=len(manifest)):
        return True
    return _MANIFESTS.get(manifest) is not None
