"""A version's first bucket packed in the thread that read the version.

Reading the tensors and packing bucket 1 are the two steps before any byte can move; each
in a worker thread of its own costs a hand-over to the event loop and back between them
(0.3-0.6 ms on the H200 host, where the whole version takes 20 ms). :func:`read_ahead`
does both in one thread: the sender then sends the ``begin`` and bucket 1 back to back.
:func:`next_plan` and :func:`pack_plan` are the steps the pipeline takes for every other
bucket, with the same errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from aiosync.core.errors import AiosyncError, MismatchError
from aiosync.core.layout import BucketPlan
from aiosync.core.planning import VersionSource
from aiosync.planes.base import SenderPlane

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
        raise MismatchError(f"cannot read the tensors: {exc}", version=version) from exc


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


def read_ahead(
    read: Callable[[], VersionSource], plane: SenderPlane, version: int, sure: bool
) -> tuple[VersionSource, BucketPlan | None]:
    """Read a version and pack its bucket 1 into buffer :data:`FIRST_BUFFER`; blocking.

    Returns what was read and bucket 1's plan (None for a version without tensors).
    ``sure``: bucket 1 will be published once packed (the engines need not accept the
    ``begin`` first), so the plane's ``queue`` hook is taken here too; otherwise the
    plane's ``publish`` does its work.
    """
    source = read()
    plan = next_plan(source.plans, version)
    if plan is None:
        return source, None
    pack_plan(plane, FIRST_BUFFER, plan, version)
    queue: Callable[[int], Any] | None = getattr(plane, "queue", None)
    if sure and queue is not None:
        queue(FIRST_BUFFER)
    return source, plan
