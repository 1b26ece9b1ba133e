"""A plane made of several producers' planes that one engine opens (colocated topologies).

Each trainer rank of an engine's range owns a ring of buffers (its own shared memory, or
CUDA IPC memory on its own GPU); the engine's source rank describes all of them in one
:class:`~aiosync.core.wire.GatheredPlaneSpec` (part ``i`` is the ``i``-th rank of the
range). A bucket lies wholly in one part: buffer ``index`` of the part that its tensors'
names say, ``"<i>/<name>"`` (:func:`part_name`). The engine's :class:`GatheredReceiverPlane`
learns the part from the checked specs (its :meth:`~GatheredReceiverPlane.expect`, which
:func:`aiosync.planes.view_bucket` calls before :meth:`~GatheredReceiverPlane.view`), so the
wire's ``Bucket`` stays as it is.

Each part opens on its own engine device: the receiver passes the devices of the engine's
sinks in rank order (:attr:`aiosync.topology.sink.RankedSink.part_devices`), and part ``i``
opens on ``devices[i]`` (:func:`part_devices`), since rank ``i``'s CUDA buffers live on the
GPU of the engine's sink ``i``. The plane orders no copies with CUDA events: it has no
``events``, so a sink waits for its own device after each bucket (parts are the ranks'
CUDA planes without events, whose packing waits: :mod:`aiosync.planes.cuda`).

The sender's :class:`GatheredSenderPlane` packs nothing itself: its ``pack`` calls the
topology's function, which has the right rank pack its share into its own buffer
``index`` (:mod:`aiosync.topology.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from aiosync.core.errors import MismatchError, ProtocolError
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.core.limits import Limits
from aiosync.core.wire import CudaPlaneSpec, GatheredPlaneSpec, ShmPlaneSpec
from aiosync.planes.base import BucketContext, ReceiverPlane, SenderPlane
from aiosync.planes.rings import open_ring

MAX_PARTS = 1024
"""Most parts (ranks of one engine) a gathered plane may name."""


def part_name(part: int, name: str) -> str:
    """The name under which part ``part``'s tensor ``name`` travels: ``"<part>/<name>"``."""
    return f"{part}/{name}"


def split_name(name: str) -> tuple[int, str]:
    """``(part, name)`` of a name made by :func:`part_name`; :class:`MismatchError` if not one."""
    head, sep, rest = name.partition("/")
    if not sep or not head.isdigit() or not rest:
        raise MismatchError("not the name of a rank's tensor ('<rank>/<name>')", tensor=name)
    return int(head), rest


def part_of(specs: list[TensorSpec], parts: int) -> int:
    """The one part every spec of a bucket names; :class:`MismatchError` otherwise."""
    if not specs:
        raise MismatchError("a bucket of a gathered plane names no tensor")
    part = split_name(specs[0].name)[0]
    for spec in specs:
        if split_name(spec.name)[0] != part:
            raise MismatchError("a bucket mixes several ranks' tensors", tensor=spec.name)
    if part >= parts:
        raise MismatchError(f"no rank {part} in a plane of {parts}", tensor=specs[0].name)
    return part


def part_devices(
    parts: int, device: torch.device, devices: Sequence[torch.device] | None
) -> list[torch.device]:
    """The device each of ``parts`` parts opens on: ``devices[i]``, else ``device`` for all.

    :class:`ProtocolError` when the engine has devices for another number of ranks.
    """
    if devices is None:
        return [device] * parts
    if len(devices) != parts:
        raise ProtocolError(f"a gathered plane of {parts} parts for an engine of {len(devices)}")
    return list(devices)


OpenPart = Callable[[ShmPlaneSpec | CudaPlaneSpec, torch.device, Limits | None], ReceiverPlane]
"""Opens one part's plane on a device (default :func:`aiosync.planes.rings.open_ring`)."""


class GatheredReceiverPlane(ReceiverPlane):
    """The engine's side: every part opened, each bucket viewed in the part its specs name.

    Part ``i`` opens on ``devices[i]`` when given (:func:`part_devices`), else on ``device``.
    """

    def __init__(
        self,
        spec: GatheredPlaneSpec,
        device: torch.device,
        limits: Limits | None = None,
        devices: Sequence[torch.device] | None = None,
        open_part: OpenPart | None = None,
    ) -> None:
        opener: OpenPart = open_ring if open_part is None else open_part
        if not 0 < len(spec.parts) <= MAX_PARTS:
            raise ProtocolError(f"a gathered plane of {len(spec.parts)} parts")
        counts = {len(part.sizes) for part in spec.parts}
        if len(counts) != 1:
            raise ProtocolError("the parts of a gathered plane differ in their buffer count")
        total = sum(sum(part.sizes) for part in spec.parts)
        if limits is not None and total > limits.max_session_bytes:  # each part is bound too
            raise ProtocolError(
                f"a gathered plane of {total} bytes (most {limits.max_session_bytes})"
            )
        where = part_devices(len(spec.parts), device, devices)
        self._parts: list[ReceiverPlane] = []
        self._current: dict[int, int] = {}
        try:
            for part, on in zip(spec.parts, where, strict=True):
                self._parts.append(opener(part, on, limits))
        except BaseException:
            self.close()
            raise

    def expect(self, index: int, specs: list[TensorSpec]) -> None:
        """Note which part buffer ``index`` is read from for this bucket (from its specs)."""
        self._current[index] = part_of(specs, len(self._parts))

    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        """The first ``used`` bytes of buffer ``index`` of the part :meth:`expect` noted."""
        part = self._current.pop(index, None)
        if part is None:
            raise MismatchError(f"buffer {index} read before its bucket's tensors were named")
        return self._parts[part].view(index, used, context)

    def close(self) -> None:
        """Release every part (idempotent)."""
        parts, self._parts = self._parts, []
        for part in parts:
            part.close()


PackPart = Callable[[int, BucketPlan], None]
"""Has the rank a plan's tensors belong to pack its share into its own buffer ``index``."""


class GatheredSenderPlane(SenderPlane):
    """The source rank's side: the gathered spec; packing is the topology's ``pack_part``."""

    def __init__(
        self, spec: GatheredPlaneSpec, count: int, capacity: int, pack_part: PackPart
    ) -> None:
        self._spec = spec
        self._count = count
        self._capacity = capacity
        self._pack_part = pack_part

    @property
    def spec(self) -> GatheredPlaneSpec:
        """Every rank's plane, in the order of the engine's range."""
        return self._spec

    @property
    def capacity(self) -> int:
        """Bytes of each buffer (every rank's are this size)."""
        return self._capacity

    @property
    def count(self) -> int:
        """Buffers in each rank's ring."""
        return self._count

    def pack(self, index: int, plan: BucketPlan) -> None:
        """Have the plan's rank pack it into its buffer ``index`` (blocking, collective)."""
        self._pack_part(index, plan)

    async def publish(self, index: int, used: int) -> None:
        """Nothing: every rank's buffer is memory the engine maps."""

    def close(self) -> None:
        """Nothing: each rank closes its own plane."""
