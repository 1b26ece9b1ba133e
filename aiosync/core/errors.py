"""The one exception tree of aiosync.

Every failure a user can see is an :class:`AiosyncError`. Messages name the peer, the
weight version and the tensor involved wherever those are known, so that a log line alone
says what went wrong and where.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager


def _context(peer: str | None, version: int | None, tensor: str | None) -> str:
    parts = []
    if peer is not None:
        parts.append(f"peer {peer}")
    if version is not None:
        parts.append(f"version {version}")
    if tensor is not None:
        parts.append(f"tensor {tensor!r}")
    return f" [{', '.join(parts)}]" if parts else ""


class AiosyncError(Exception):
    """Base of every error aiosync raises; carries the peer, version and tensor it concerns."""

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        version: int | None = None,
        tensor: str | None = None,
    ) -> None:
        super().__init__(message + _context(peer, version, tensor))
        self.reason = message
        self.peer = peer
        self.version = version
        self.tensor = tensor


class ProtocolError(AiosyncError):
    """A message was malformed, truncated, unknown or arrived out of order."""


class MismatchError(AiosyncError, ValueError):
    """A tensor cannot be sent or does not fit the receiving model (name, dtype, shape, bytes)."""


class RejectedError(AiosyncError):
    """The peer refused a bucket or a commit; ``reason`` holds the peer's own message."""


class BusyError(RejectedError):
    """The engine is taking another sender's version; the same request may succeed later."""


class SyncTimeoutError(AiosyncError, TimeoutError):
    """A step waited longer than its configured timeout (the peer may be gone or stuck)."""


class InDoubtError(SyncTimeoutError):
    """An engine went silent with a commit sent to it: it may have made the version live.

    An engine makes nothing live past the commit's deadline, so it holds the version only
    if it took the commit before then; its version shows when it is contacted again (the
    ``ready`` of a new session: ``WeightSender.remote_versions`` after ``add_engine``).
    """


class PeerGoneError(AiosyncError):
    """The peer disconnected or announced it is closing while work was outstanding."""


class UsageError(AiosyncError, RuntimeError):
    """The API was misused in this process (not open, two sends at once); no peer is at fault."""


class FleetError(AiosyncError):
    """Several engines failed one version; ``failures`` maps each engine to its own error."""

    def __init__(
        self, message: str, failures: dict[str, AiosyncError], *, version: int | None
    ) -> None:
        detail = "; ".join(f"{peer}: {exc.reason}" for peer, exc in failures.items())
        super().__init__(f"{message}: {detail}", version=version)
        self.failures = failures


def breaks_session(exc: AiosyncError) -> bool:
    """True for errors after which a session cannot be trusted (timeouts, lost peers)."""
    return isinstance(exc, SyncTimeoutError | PeerGoneError | ProtocolError)


ErrorMap = Mapping[type[BaseException], Callable[[BaseException], AiosyncError]]


@contextmanager
def map_exceptions(mapping: ErrorMap) -> Iterator[None]:
    """Re-raise a library's errors as aiosync errors, at one interface instead of every call.

    ``mapping`` sends an exception class to a function building the aiosync error from the
    caught exception (first matching class wins); anything unmapped passes through.
    """
    try:
        yield
    except AiosyncError:
        raise
    except Exception as exc:
        for kind, build in mapping.items():
            if isinstance(exc, kind):
                raise build(exc) from exc
        raise
