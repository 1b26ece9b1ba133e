"""An engine's rules for version numbers and commit deadlines, as pure functions.

Versions grow, each by at most ``Limits.max_version_step`` past the current one, unless the
engine allows a sender to restart the numbering (``Begin.rebase``); a refusal names the
session that set the current version, so an operator sees who moved the engine ahead. A
commit carries the sender's deadline on a clock both ends share (``Commit.deadline``,
``time.time()``): past it, the sender has given up, and the engine makes nothing live.
"""

from __future__ import annotations

from aiosync.core.errors import ProtocolError
from aiosync.core.limits import Limits


def check_version(
    version: int, current: int | None, *, rebase: bool, limits: Limits, set_by: str | None
) -> None:
    """Raise unless ``version`` may follow ``current`` (``set_by``: who committed it)."""
    if rebase:
        if not limits.allow_rebase:
            raise ProtocolError("this engine does not allow restarting the version numbering")
        return
    if current is None:
        return
    by = f" (set by {set_by})" if set_by else ""
    if version <= current:
        raise ProtocolError(f"version {version} is not newer than current {current}{by}")
    if version - current > limits.max_version_step:
        step = limits.max_version_step
        raise ProtocolError(f"version {version} jumps more than {step} past {current}{by}")


def past_deadline(deadline: float | None, now: float) -> str | None:
    """Why a commit may not go live at wall time ``now``: past its ``deadline`` (or None)."""
    if deadline is None or now <= deadline:
        return None
    return (
        f"{now - deadline:.3f}s past the sender's deadline (the sender gave up on this "
        "commit); nothing was made live"
    )
