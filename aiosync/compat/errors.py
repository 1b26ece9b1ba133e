"""Errors of the NeMo-RL drop-in names: NeMo-RL's exception types that are also aiosync's.

Code written against ``nemo_rl.models.policy.utils`` catches the builtin types its functions
raise (``ValueError``, ``KeyError``, ``AssertionError`` where NeMo-RL asserts,
``RuntimeError`` for a failed stream, ``TimeoutError`` for a silent peer); code written
against aiosync catches :class:`~aiosync.AiosyncError`. Every class here is both, so
either ``except`` clause works.
"""

from __future__ import annotations

from aiosync import AiosyncError, PeerGoneError, ProtocolError, RejectedError

__all__ = [
    "CompatAssertionError",
    "CompatImportError",
    "CompatKeyError",
    "CompatPeerGoneError",
    "CompatProtocolError",
    "CompatRejectedError",
    "CompatRuntimeError",
    "CompatTypeError",
    "CompatValueError",
    "translate",
]


class CompatValueError(AiosyncError, ValueError):
    """A bad argument value, where NeMo-RL raises ``ValueError``."""


class CompatTypeError(AiosyncError, TypeError):
    """An argument of the wrong type, where NeMo-RL raises ``TypeError``."""


class CompatKeyError(AiosyncError, KeyError):
    """A missing key, where NeMo-RL raises ``KeyError``; its message reads as plain text."""

    def __str__(self) -> str:
        return BaseException.__str__(self)  # KeyError would show the message quoted


class CompatAssertionError(AiosyncError, AssertionError):
    """Inconsistent input that NeMo-RL checks with ``assert`` (raised here even under -O)."""


class CompatRuntimeError(AiosyncError, RuntimeError):
    """A failure while running, where NeMo-RL raises ``RuntimeError``."""


class CompatImportError(AiosyncError, ImportError):
    """An optional dependency is missing; the message names the extra that installs it."""


class CompatPeerGoneError(PeerGoneError, RuntimeError):
    """The engine went away during a stream (NeMo-RL: ``RuntimeError`` from a ZMQ error)."""


class CompatRejectedError(RejectedError, RuntimeError):
    """The engine refused a bucket or the commit (NeMo-RL: ``RuntimeError``)."""


class CompatProtocolError(ProtocolError, RuntimeError):
    """The engine answered out of protocol (NeMo-RL: ``RuntimeError``)."""


# Most specific first: a subclass must be looked up before its base.
_BUILTIN = (
    (KeyError, CompatKeyError),
    (AssertionError, CompatAssertionError),
    (ImportError, CompatImportError),
    (TypeError, CompatTypeError),
    (ValueError, CompatValueError),
    (RuntimeError, CompatRuntimeError),
)
_OURS = (
    (PeerGoneError, CompatPeerGoneError),
    (RejectedError, CompatRejectedError),
    (ProtocolError, CompatProtocolError),
)


def translate(exc: Exception, context: str = "") -> Exception:
    """Return the compat error to raise for ``exc``; chain it with ``raise ... from exc``.

    An error that already is both an :class:`~aiosync.AiosyncError` and a builtin type
    NeMo-RL raises (``MismatchError`` is a ``ValueError``, ``SyncTimeoutError`` a
    ``TimeoutError``) comes back unchanged. Builtin errors become their compat class, and
    aiosync's stream errors become their ``RuntimeError`` twins, keeping the peer, version
    and tensor. ``context`` (e.g. ``"policy (rank 0)"``) prefixes the message. Anything else
    is returned as is.
    """
    prefix = f"{context}: " if context else ""
    if isinstance(exc, AiosyncError):
        if isinstance(exc, ValueError | TypeError | KeyError | RuntimeError | TimeoutError):
            return exc
        for ours, twin in _OURS:
            if isinstance(exc, ours):
                return twin(
                    prefix + exc.reason, peer=exc.peer, version=exc.version, tensor=exc.tensor
                )
        return CompatRuntimeError(
            prefix + exc.reason, peer=exc.peer, version=exc.version, tensor=exc.tensor
        )
    for builtin, compat in _BUILTIN:
        if isinstance(exc, builtin):
            message = exc.args[0] if len(exc.args) == 1 else str(exc)
            return compat(prefix + str(message))
    return exc
