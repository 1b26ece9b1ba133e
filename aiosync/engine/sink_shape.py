"""The check that a user's sink has every member a receiver calls, made when it starts.

A sink written against an older aiosync (one without ``expectations()`` or ``staged``, say)
would otherwise fail the first time the receiver reaches for the missing member: at start
with a bare ``AttributeError``, or only when a trainer's stream arrives, with a message
naming nothing but the attribute. :func:`check_sink` names every missing member at once.
"""

from __future__ import annotations

from aiosync.core.errors import UsageError

METHODS = ("expectations", "apply_bucket", "commit", "abort")
"""What a receiver calls on every sink (:class:`~aiosync.engine.sinks.WeightSink`)."""
PROPERTIES = ("device", "staged")
"""What a receiver reads on every sink."""


def missing_members(sink: object) -> list[str]:
    """The members of :class:`~aiosync.engine.sinks.WeightSink` that ``sink`` lacks.

    Methods are named with ``()``; a method that is there but not callable counts as missing.
    """
    missing = [name for name in PROPERTIES if not hasattr(sink, name)]
    missing += [f"{name}()" for name in METHODS if not callable(getattr(sink, name, None))]
    return missing


def check_sink(sink: object) -> None:
    """Raise :class:`UsageError` naming each member ``sink`` lacks, before anything runs."""
    missing = missing_members(sink)
    if not missing:
        return
    raise UsageError(
        f"{type(sink).__name__} is not a weight sink: it has no {', '.join(missing)}. A sink "
        "needs device, staged, expectations() (None takes any tensor), "
        "apply_bucket(bucket, specs), commit(version) and abort() "
        "(aiosync.engine.sinks.WeightSink; ModuleSink and CallbackSink have them all)"
    )
