"""Peer processes for the tests: start ``python -m MODULE ROLE ...``, read its events.

A peer module (``tests.helpers.cuda_peers``, ``tests.helpers.direct_peers``) prints one JSON
object a line,
each with an ``event`` key; :func:`process` starts one with stdout piped (and stdin too,
with ``stdin=True``) and kills it, if still running, when the block ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def process(
    module: str, *argv: str, env: dict[str, str] | None = None, stdin: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """``python -m module *argv`` in the repository root, killed and reaped at the end."""
    from aiosync.runtime import child_env

    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**child_env(), **(env or {})},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for pipe in (proc.stdout, proc.stdin):
            if pipe is not None:
                pipe.close()


def events(proc: subprocess.Popen[str]) -> Iterator[dict[str, object]]:
    """The peer's events as they come, until its stdout closes."""
    assert proc.stdout is not None
    for line in proc.stdout:
        yield json.loads(line)


def first(proc: subprocess.Popen[str], kind: str) -> dict[str, object]:
    """The peer's next event of ``kind`` (the ones before it are dropped)."""
    for event in events(proc):
        if event["event"] == kind:
            return event
    raise AssertionError(f"no {kind} event; exit {proc.wait(timeout=30)}")


def ask(proc: subprocess.Popen[str], kind: str) -> dict[str, object]:
    """Write a line to the peer's stdin; its next event of ``kind`` (its answer)."""
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    return first(proc, kind)
