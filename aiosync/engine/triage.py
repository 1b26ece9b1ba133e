"""How the receiver sizes up a message before the session sees it, and words a sink's error.

Checks that walk many tensors run off the event loop (:func:`walks_tensors` says which);
an exception from the user's sink becomes an :class:`~aiosync.core.errors.AiosyncError`
naming the bucket's first tensors (:func:`apply_error`).
"""

from __future__ import annotations

from aiosync.core.engine_actions import Apply
from aiosync.core.errors import AiosyncError
from aiosync.core.where_to_run import on_loop
from aiosync.core.wire import Begin, Bucket, Complete, Message


def walks_tensors(message: Message) -> bool:
    """True for messages whose checks visit many tensors (run off the event loop)."""
    if isinstance(message, Begin):
        return not on_loop(checked=len(message.manifest or ()))
    if isinstance(message, Bucket):
        return not on_loop(checked=len(message.slots) + len(message.specs))
    return isinstance(message, Complete)


def apply_error(action: Apply, exc: Exception) -> AiosyncError:
    """``exc`` from applying ``action``'s bucket, as an aiosync error naming its tensors."""
    if isinstance(exc, AiosyncError):
        return exc
    names = ", ".join(spec.name for spec in action.specs[:3])
    return AiosyncError(
        f"engine failed to apply bucket ({names}): {exc}",
        tensor=action.specs[0].name if action.specs else None,
    )
