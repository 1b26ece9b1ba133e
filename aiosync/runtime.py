"""Event-loop helpers: run a coroutine on uvloop when installed, and unwrap task-group errors."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def child_env() -> dict[str, str]:
    """Environment for a child Python process that must import this same aiosync.

    The package's root goes first on ``PYTHONPATH`` (it may have been found through a path
    tweak rather than an install); output is unbuffered so JSON lines arrive promptly.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop_process(proc: subprocess.Popen[Any], grace: float) -> None:
    """Wait up to ``grace`` seconds for a child to exit, then terminate it, then kill it."""
    for step in (None, proc.terminate, proc.kill):
        if step is not None:
            step()
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def uvloop_available() -> bool:
    """True when uvloop can be imported on this platform."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(main: Callable[[], Coroutine[Any, Any, T]], *, use_uvloop: bool | None = None) -> T:
    """Run ``main()`` to completion on a fresh loop; uvloop when available unless told not to."""
    if use_uvloop is None:
        use_uvloop = uvloop_available()
    if use_uvloop:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        return runner.run(main())


def require_asyncio(what: str) -> None:
    """Raise :class:`~aiosync.core.errors.UsageError` unless an asyncio loop runs this task.

    aiosync drives ZMQ through asyncio (uvloop included); anyio's other backend, trio, is
    not supported, and failing here is clearer than failing deep inside a socket call.
    """
    from aiosync.core.errors import UsageError

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise UsageError(
            f"{what} needs an asyncio event loop (uvloop optional); this one is not asyncio"
        ) from None


def unwrap_group(exc: BaseException) -> BaseException:
    """The error that explains a (nested) exception group, or the group itself.

    Stages that fail together (say two timeouts) raise a group; the first aiosync error in
    it is the one to report, since the others are consequences of the same stall.
    """
    from aiosync.core.errors import AiosyncError

    while isinstance(exc, BaseExceptionGroup):
        real = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        ours = [e for e in real if isinstance(e, AiosyncError | BaseExceptionGroup)]
        if len(real) == 1:
            exc = real[0]
        elif ours:
            exc = ours[0]
        else:
            return exc
    return exc
