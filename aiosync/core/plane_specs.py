"""The data planes' specs as they travel in the hello: how an engine reaches a peer's buckets.

Each is a tagged :class:`msgspec.Struct`, decoded as hostile input with the rest of
:mod:`aiosync.core.wire` (which re-exports them); the planes themselves are in
:mod:`aiosync.planes`.
"""

from __future__ import annotations

import msgspec


class ShmHandle(msgspec.Struct, frozen=True, tag="shm"):
    """A POSIX shared-memory segment of ``size`` bytes, opened by ``name``."""

    name: str
    size: int


class ShmPlaneSpec(msgspec.Struct, frozen=True, tag="shm"):
    """A data plane of shared-memory buffers on this host."""

    buffers: list[ShmHandle]

    @property
    def sizes(self) -> list[int]:
        """Bytes of each buffer, in the order buckets name them."""
        return [handle.size for handle in self.buffers]


class CudaPlaneSpec(msgspec.Struct, frozen=True, tag="cuda"):
    """CUDA buffers of ``size`` bytes on ``device`` with legacy IPC handles (``cudaMalloc``).

    ``handles`` are ``cudaIpcMemHandle_t`` bytes, ``events`` one ``cudaIpcEventHandle_t``
    per buffer, recorded once a bucket is packed there (see :mod:`aiosync.planes.cuda`);
    none: the trainer packed each bucket before sending it, and the engine synchronises.
    ``counter``: the handle of the trainer's counters, device memory whose 32-bit word
    ``counter_word`` is this engine's: the trainer sets it as it packs a bucket sent ahead
    (``Bucket.after``); empty: none.
    """

    device: int
    size: int
    handles: list[bytes]
    events: list[bytes] = []
    counter: bytes = b""
    counter_word: int = 0

    @property
    def sizes(self) -> list[int]:
        """Bytes of each buffer, in the order buckets name them."""
        return [self.size] * len(self.handles)


CudaLegacyPlaneSpec = CudaPlaneSpec
"""The name :class:`CudaPlaneSpec` had until the one CUDA plane (tag ``cuda_legacy``)."""


class CollectivePlaneSpec(msgspec.Struct, frozen=True, tag="collective"):
    """Buckets broadcast from rank 0 of a side process group (NCCL or Gloo).

    The engine joins group ``group`` of ``world_size`` ranks through the store at
    ``host``:``port`` under the key prefix of ``token`` (so the token must only travel on
    an authenticated channel), takes the next free rank, and receives each bucket into
    one of ``count`` buffers of ``capacity`` bytes: one broadcast per bucket, or one per
    tensor when ``per_tensor``. ``timeout_ms`` bounds each collective. Over NCCL every
    engine copies a bucket out while it receives the next one (see
    :mod:`aiosync.collectives.ordered`). ``store_path``, when set, names the trainer's
    private rendezvous file instead of a ``TCPStore`` (``port`` is then 0). ``secret`` is
    this session's own: the engine proves its rank with it before any broadcast
    (:mod:`aiosync.collectives.admission`); it never goes into the store.
    """

    backend: str
    host: str
    port: int
    token: str
    group: str
    world_size: int
    count: int
    capacity: int
    per_tensor: bool = False
    timeout_ms: int = 60_000
    secret: str = ""
    store_path: str = ""

    @property
    def sizes(self) -> list[int]:
        """Bytes of each buffer, in the order buckets name them."""
        return [self.capacity] * self.count


class GatheredPlaneSpec(msgspec.Struct, frozen=True, tag="gathered"):
    """Several producers' rings of buffers that one engine opens (a colocated topology).

    ``parts[i]`` is trainer rank ``i``'s own plane (the ``i``-th rank of the engine's
    range); every part has the same number of buffers. A bucket lies wholly in one part's
    buffer: the part named by its tensors' ``"<i>/"`` prefix (see
    :mod:`aiosync.planes.gathered`). ``sizes`` are the smallest of the parts' buffers.
    """

    parts: list[ShmPlaneSpec | CudaPlaneSpec]

    @property
    def sizes(self) -> list[int]:
        """Bytes of each buffer, in the order buckets name them (the smallest part's)."""
        if not self.parts:
            return []
        return [min(sizes) for sizes in zip(*(part.sizes for part in self.parts), strict=False)]


class CudaRegion(msgspec.Struct, frozen=True, tag="cuda_region"):
    """A trainer's own ``cudaMalloc`` allocation of ``size`` bytes: its legacy IPC handle.

    Trainer memory in direct mode, or a colocated rank's buffer
    (:class:`~aiosync.core.colocated_parts.RankPart`).
    """

    handle: bytes
    size: int


class CudaFdRegion(msgspec.Struct, frozen=True, tag="cuda_fd_region"):
    """Trainer memory mapped from physical allocations (``cuMemCreate``), with no legacy handle.

    What torch's allocator makes under ``expandable_segments:True``. ``pieces``: the bytes
    of each physical allocation, mapped one after the other from the region's start;
    ``size``: their sum, the bytes engines may read. An engine asks the trainer for one file
    descriptor a piece, by ``ident`` (the trainer's name for the region, never reused by
    one sender), over the socket its :class:`DescriptorSource` names
    (:mod:`aiosync.planes.fd_passing`).
    """

    ident: int
    pieces: tuple[int, ...]
    size: int


Region = ShmHandle | CudaRegion | CudaFdRegion
"""A block of trainer memory an engine reads tensors from directly (direct mode)."""


class DescriptorSource(msgspec.Struct, frozen=True):
    """Where an engine asks a trainer for the file descriptors of its fd regions.

    ``path``: the trainer's UNIX socket (in a directory only its user may enter); ``pid``
    and ``pid_namespace``: the trainer process, which the engine checks the socket's peer
    against (``SO_PEERCRED``); ``token``: the secret the engine shows with each request
    (it travels only in the hello, so only on the authenticated channel).
    """

    path: str
    pid: int
    pid_namespace: int
    token: bytes


class DirectPlaneSpec(msgspec.Struct, frozen=True, tag="direct"):
    """A ring of buffers plus direct reads of the trainer's own memory (direct mode).

    Buffers ``0 .. n-1`` are ``ring``'s; buffer ``n`` is the direct one: a bucket there
    names its regions (``Bucket.regions``, at most ``direct_bytes`` in all) and its offsets
    run through them in order, each region taking its size rounded up to the alignment.
    ``start_event`` (CUDA): an IPC event the trainer records on its stream as a version
    starts; the engine's reads of its memory wait on it. ``descriptors`` (CUDA): where the
    engine fetches the file descriptors of :class:`CudaFdRegion` regions (None: the
    trainer names none). See :mod:`aiosync.planes.direct`.
    """

    ring: ShmPlaneSpec | CudaPlaneSpec
    direct_bytes: int
    start_event: bytes = b""
    descriptors: DescriptorSource | None = None

    @property
    def sizes(self) -> list[int]:
        """Bytes of each buffer: the ring's, then the most a direct bucket may span."""
        return [*self.ring.sizes, self.direct_bytes]


PlaneSpec = ShmPlaneSpec | CudaPlaneSpec | CollectivePlaneSpec | GatheredPlaneSpec | DirectPlaneSpec
"""How an engine reaches the bytes of buckets; new planes add a tagged member here."""
