"""What a relay takes from its upstream: a version's head, checked whole (pure, no IO).

A relay treats its upstream as an engine treats a sender: as hostile input, bounded by the
same :class:`~aiosync.core.limits.Limits` (``ServerConfig.upstream_limits``). A head is
checked before anything is allocated or asked for, so a version the relay could not hold
costs it nothing but the head:

* ``max_buffers``: buckets in one version (each becomes one segment of the plane a
  subscriber maps, which its own ``max_buffers`` bounds too);
* ``max_session_bytes``: bytes of one version, all its buckets together, repeated ones
  counted each time (each is copied into a segment of its own);
* ``max_bucket_tensors``, ``max_manifest_tensors``, ``max_name_length``: tensors per
  bucket, distinct tensors per version, characters in a name.

A version must be newer than the relay's newest, but may jump any distance past it
(``max_version_step`` is not applied): a relay follows the newest version and skips the
ones published while it was away, however many.

Each spec must lie inside its bucket with a known dtype and no negative dimension; the
relay's subscribers check the rest, as they would a trainer's.
"""

from __future__ import annotations

import aiosync.server.messages as m
from aiosync.core.errors import ProtocolError
from aiosync.core.layout import TensorSpec, dtype_from_name
from aiosync.core.limits import Limits, shorten
from aiosync.engine.held import DIGEST_BYTES

NAME_SHOWN = 64
"""Characters of a peer's tensor name an error shows."""


def check_newer(version: int, have: int | None) -> None:
    """Raise a :class:`ProtocolError` unless ``version`` is newer than ``have``."""
    if have is not None and version <= have:
        raise ProtocolError(f"version {version} is not newer than {have}", version=version)


def check_buckets(head: m.Head, limits: Limits) -> None:
    """Raise a :class:`ProtocolError` unless every bucket of ``head`` lies within ``limits``.

    The error names the version, and the bucket and tensor where one is at fault. Walks
    every spec: call it from a worker thread for a large head.
    """
    version = head.version
    count, most = len(head.buckets), limits.max_buffers
    if not 0 < count <= most:
        raise ProtocolError(f"{count} buckets (1-{most} per version)", version=version)
    total = 0
    names: set[str] = set()
    for index, bucket in enumerate(head.buckets):
        total += bucket.used
        if bucket.used <= 0:
            raise ProtocolError(f"bucket {index} of {bucket.used} bytes", version=version)
        if total > limits.max_session_bytes:
            raise ProtocolError(
                f"bucket {index} of {bucket.used} bytes: the version would hold {total} "
                f"bytes (at most {limits.max_session_bytes}, max_session_bytes)",
                version=version,
            )
        if len(bucket.digest) != DIGEST_BYTES:
            raise ProtocolError(f"bucket {index} has a malformed digest", version=version)
        tensors, most = len(bucket.specs), limits.max_bucket_tensors
        if not 0 < tensors <= most:
            raise ProtocolError(f"bucket {index} of {tensors} tensors (1-{most})", version=version)
        for spec in bucket.specs:
            _check_spec(spec, index, bucket.used, version, limits.max_name_length)
            names.add(spec.name)
        if len(names) > limits.max_manifest_tensors:
            most = limits.max_manifest_tensors
            raise ProtocolError(
                f"more than {most} tensors by bucket {index} (max_manifest_tensors)",
                version=version,
            )


def _check_spec(spec: TensorSpec, index: int, used: int, version: int, max_name: int) -> None:
    """One spec: a name within bounds, a known dtype and shape, inside its bucket."""
    name = shorten(spec.name, NAME_SHOWN)
    if len(spec.name) > max_name:
        raise ProtocolError(
            f"bucket {index}: a tensor name of {len(spec.name)} characters (at most {max_name})",
            version=version,
            tensor=name,
        )
    try:
        dtype_from_name(spec.dtype)
    except ProtocolError as exc:
        raise ProtocolError(f"bucket {index}: {exc.reason}", version=version, tensor=name) from None
    if any(dim < 0 for dim in spec.shape):
        raise ProtocolError(f"bucket {index}: a negative dimension", version=version, tensor=name)
    if spec.offset < 0 or spec.nbytes < 0 or spec.offset + spec.nbytes > used:
        raise ProtocolError(
            f"bucket {index}: spec outside its {used}-byte bucket", version=version, tensor=name
        )
