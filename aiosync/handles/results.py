"""Reading engines' answers as plain data: pure functions, no IO.

Engines answer weight-update calls in several shapes: SGLang's ``(success, message)``
tuple (sometimes with more fields after), a dict with ``success`` and a text under
``message``, ``error_message`` or ``error``, an object with those attributes, ``None`` or
``True`` for engines that return nothing on success. :func:`as_result` turns any of them
into a :class:`~aiosync.handles.base.WeightSyncResult`; :func:`failures` lists the failed
ones by engine, for a caller to raise on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aiosync.handles.base import WeightSyncResult

TEXT_KEYS = ("message", "error_message", "error")
"""Where an engine's text may be, in the order looked at."""

MAX_TEXT = 4096
"""Characters of an engine's text kept (a hostile or broken engine may send a lot)."""


def _text(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def _from_mapping(reply: Mapping[object, object]) -> WeightSyncResult:
    success = reply.get("success", True)
    text = next((reply[key] for key in TEXT_KEYS if reply.get(key)), "")
    return WeightSyncResult(success=success is not False, message=_text(text))


def _from_object(reply: object) -> WeightSyncResult:
    success = getattr(reply, "success", True)
    text: object = ""
    for key in TEXT_KEYS:
        value = getattr(reply, key, None)
        if value:
            text = value
            break
    return WeightSyncResult(success=success is not False, message=_text(text))


def as_result(reply: object) -> WeightSyncResult:
    """One engine answer as a :class:`WeightSyncResult`.

    Only an explicit ``False`` (the value, or the ``success`` field of a tuple, dict or
    object) is a failure: ``None``, ``True`` and answers without a ``success`` field are
    successes, as SGLang-style callers treat them. The text is the first non-empty of
    ``message``, ``error_message`` and ``error``, cut to :data:`MAX_TEXT` characters.
    """
    if isinstance(reply, WeightSyncResult):
        return reply
    if reply is None or reply is True:
        return WeightSyncResult(success=True)
    if reply is False:
        return WeightSyncResult(success=False, message="the engine returned False")
    if isinstance(reply, Mapping):
        return _from_mapping(reply)
    if isinstance(reply, tuple | list):
        if not reply:
            return WeightSyncResult(success=True)
        if isinstance(reply[0], bool):
            text = reply[1] if len(reply) > 1 and reply[1] else ""
            return WeightSyncResult(success=reply[0], message=_text(text))
        return WeightSyncResult(success=True)
    return _from_object(reply)


def failures(results: Sequence[object], names: Sequence[str] | None = None) -> list[str]:
    """``"<engine>: <text>"`` for every result that says it failed, in order.

    ``names`` names the engines (by position when absent: ``engine 0``, ...). A list
    result whose first entry is not a bool holds one answer per engine rank and fails when
    any of them fails (``[False, "text"]`` is one answer).
    """
    out: list[str] = []
    for i, reply in enumerate(results):
        who = names[i] if names is not None and i < len(names) else f"engine {i}"
        parts: list[object] = [reply]
        if isinstance(reply, list) and reply and not isinstance(reply[0], bool):
            parts = reply
        for part in parts:
            result = as_result(part)
            if not result.success:
                out.append(f"{who}: {result.message or 'failed without a message'}")
    return out
