"""A version's first bucket packed in the thread that read the version.

Reading the tensors and packing bucket 1 are the two steps before any byte can move; each
in a worker thread of its own costs a hand-over to the event loop and back between them
(0.3-0.6 ms on the H200 host, where the whole version takes 20 ms). :func:`read_ahead`
does both in one thread: the sender then sends the ``begin`` and bucket 1 back to back.
Where the read is bounded work and bucket 1 has nothing to pack (a direct-mode version
whose split still holds), :func:`read_here` does it on the caller's thread, with no hop
at all: a hop to a worker that was idle costs 0.15-0.6 ms on that host.
:func:`next_plan` and :func:`pack_plan` are the steps the pipeline takes for every other
bucket, with the same errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aiosync.core.errors import AiosyncError, MismatchError
from aiosync.core.layout import BucketPlan
from aiosync.core.planning import VersionSource
from aiosync.planes.base import SenderPlane, regions_of

FIRST_BUFFER = 0
"""The buffer bucket 1 is packed into: every buffer is free when a version starts."""


def next_plan(plans: Iterator[BucketPlan], version: int) -> BucketPlan | None:
    """The next bucket's plan, or None after the last.

    A tensor that cannot be read raises :class:`MismatchError`.
    """
    try:
        return next(plans, None)
    except AiosyncError:
        raise
    except Exception as exc:
        raise MismatchError(
            f"cannot read the tensors: {type(exc).__name__}: {exc}", version=version
        ) from exc


def pack_plan(plane: SenderPlane, index: int, plan: BucketPlan, version: int) -> None:
    """Pack ``plan`` into buffer ``index``; a failure names the version and a tensor.

    The plan's tensors are let go of afterwards (a generator's may be freed).
    """
    try:
        plane.pack(index, plan)
    except MismatchError as exc:  # names the tensor that failed
        raise MismatchError(exc.reason, version=version, tensor=exc.tensor) from exc
    except AiosyncError:  # the plane's own failure (a broadcast timed out, a peer gone)
        raise
    except Exception as exc:
        names = ", ".join(spec.name for spec in plan.specs[:3])
        raise MismatchError(
            f"cannot pack ({names}): {exc}", version=version, tensor=plan.first_name
        ) from exc
    plan.tensors.clear()


@dataclass(frozen=True)
class PackedAhead:
    """Bucket 1 as :func:`read_ahead` left it, its send not queued yet.

    ``plan``: packed into buffer :data:`FIRST_BUFFER` (None for a version without
    buckets), after the plane's ``begin_version``. A plane's ``queue`` hook waits until
    the bucket's message is ready.
    """

    plan: BucketPlan | None


def read_ahead(
    read: Callable[[], VersionSource], plane: SenderPlane, version: int
) -> tuple[VersionSource, PackedAhead]:
    """Read a version and pack its bucket 1 into buffer :data:`FIRST_BUFFER`; blocking.

    Call the plane's ``begin_version`` first, on the caller's thread. A plane with a
    ``queue`` hook (a collective plane) queues bucket 1's send only when it is published,
    so a version that fails before that leaves nothing queued.
    """
    source = read()
    plan = next_plan(source.plans, version)
    if plan is not None:
        pack_plan(plane, FIRST_BUFFER, plan, version)
    return source, PackedAhead(plan)


def read_here(
    read: Callable[[], VersionSource | None], plane: SenderPlane, version: int
) -> tuple[VersionSource, PackedAhead] | None:
    """:func:`read_ahead` on the caller's thread, for a ``read`` that is bounded work.

    ``read`` returns None where it would not be (then so does this, and nothing was
    read), or a version whose bucket 1, if any, has nothing to pack (a direct bucket):
    a bucket to pack would be planned and packed here, on the event loop.
    """
    source = read()
    if source is None:
        return None
    plan = next_plan(source.plans, version)
    if plan is not None:
        if not regions_of(plan):  # a direct plan names its regions
            raise RuntimeError("read_here: bucket 1 is to pack; read it in a thread")
        pack_plan(plane, FIRST_BUFFER, plan, version)  # no bytes to copy
    return source, PackedAhead(plan)
