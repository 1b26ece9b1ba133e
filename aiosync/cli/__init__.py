"""The ``aiosync`` command (also ``python -m aiosync``): ``demo``, ``bench`` and two roles.

Modules: :mod:`~aiosync.cli.args` (the parser), :mod:`~aiosync.cli.checks` (the values'
checks), :mod:`~aiosync.cli.roles` (the ``trainer`` and ``engine`` processes),
:mod:`~aiosync.cli.spawn` (starting and following them), :mod:`~aiosync.cli.demo` and
:mod:`~aiosync.cli.bench` (the two user commands), :mod:`~aiosync.cli.serve` (the server).

Signals are handled here only, never by the library: in the command's own processes
SIGTERM unwinds like Ctrl-C does, so ``finally`` blocks and context managers remove private
directories, shared memory and child processes before the exit (status 143; 130 for
SIGINT). :func:`main` arranges that for synchronous code; while a role's event loop runs,
:func:`aiosync.cli.roles.run_role` turns the signal into cancelling the role instead. A
second SIGTERM or SIGINT ends the process at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType

from aiosync.cli.args import build_parser
from aiosync.cli.channel_flags import check_channel_flags
from aiosync.cli.checks import CommandError, check_model_size, resolve_device

__all__ = ["main"]

log = logging.getLogger("aiosync.cli")


def _commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    from aiosync.cli.bench import bench
    from aiosync.cli.demo import demo
    from aiosync.cli.keygen import keygen
    from aiosync.cli.roles import ROLES
    from aiosync.cli.serve import serve

    return {"demo": demo, "bench": bench, **ROLES, "keygen": keygen, "serve": serve}


def _unwind_on_signals() -> None:
    """SIGTERM raises ``SystemExit(143)``, SIGINT ``KeyboardInterrupt``: both unwind the stack.

    Each handler runs once; it then restores the default action, so a second signal ends
    the process even if cleaning up hangs. A SIGINT that the parent shell ignores (a
    background job) stays ignored.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, handler)


def _setup_logging(level: str, command: str) -> None:
    role = f" [{command}]" if command in ("engine", "trainer") else ""
    logging.basicConfig(level=level, format=f"%(asctime)s{role} %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aiosync`` command; returns the exit status."""
    parser = build_parser(_commands())
    args = parser.parse_args(argv)
    _setup_logging(args.log_level, args.command)
    try:
        if hasattr(args, "device"):  # keygen has none
            args.device = resolve_device(args.device)
        check_channel_flags(args)
        if hasattr(args, "size_mb"):
            check_model_size(args.size_mb, args.device)
    except CommandError as exc:
        parser.error(str(exc))
    _unwind_on_signals()
    try:
        return int(args.func(args))
    except BaseException as exc:  # sorted out there; what is a bug is raised again
        return _exit_status(exc, args)


def _exit_status(exc: BaseException, args: argparse.Namespace) -> int:
    """Report a failure in one line and return the exit status, or re-raise what is a bug.

    Errors from inside task groups arrive wrapped in exception groups: the error that
    explains the group is the one judged (a signal's ``SystemExit`` among them).
    """
    from aiosync import AiosyncError
    from aiosync.cli.roles import NoVersionError, emit
    from aiosync.runtime import unwrap_group

    prog = f"aiosync {args.command}"
    cause = unwrap_group(exc)
    if isinstance(cause, SystemExit):
        return cause.code if isinstance(cause.code, int) else 1
    if isinstance(cause, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    if not isinstance(cause, CommandError | NoVersionError | AiosyncError | ValueError):
        raise exc
    if args.log_level == "DEBUG":
        traceback.print_exception(exc)
    if args.command in ("engine", "trainer"):  # the parent reads stdout, a person stderr
        emit("timeout" if isinstance(cause, NoVersionError) else "error", message=str(cause))
    status = cause.status if isinstance(cause, CommandError) else 1
    print(f"{prog}: {'error: ' if status == 2 else ''}{cause}", file=sys.stderr)
    return status
