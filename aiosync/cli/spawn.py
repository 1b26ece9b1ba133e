"""The parent side of ``demo`` and ``bench``: start engines and a trainer, follow them.

The roles run as ``python -m aiosync engine|trainer ...`` child processes that talk over
an ``ipc://`` socket in a private directory (see :mod:`aiosync.private_dirs`). Their JSON
lines on stdout drive the progress shown here; their stderr (logging) passes straight
through. Children still running on the way out, normal or not, are terminated, and the
directory is removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import IO, Any

from aiosync.cli.checks import CommandError, MiB
from aiosync.private_dirs import make_private_dir


@contextmanager
def spawn(role: str, argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """Start ``python -m aiosync <role>``; it is terminated on the way out if still running."""
    from aiosync.runtime import child_env, stop_process

    proc = subprocess.Popen(
        [sys.executable, "-m", "aiosync", role, *argv],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            stop_process(proc, grace=10)
        if proc.stdout is not None:
            proc.stdout.close()


def events(stream: IO[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects among a child's stdout lines."""
    for line in stream:
        line = line.strip()
        if line.startswith("{"):
            yield json.loads(line)


def _wait(proc: subprocess.Popen[str], role: str, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommandError(f"the {role} process did not exit within {timeout:g}s") from None


class Progress:
    """Progress on stderr: a live bar on a terminal, one line per version otherwise."""

    def __init__(self, versions: int, enabled: bool) -> None:
        self.versions = versions
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()

    def update(self, version: int, done: int, total: int) -> None:
        """Redraw the bar (terminals only): ``done`` of ``total`` bytes of ``version``."""
        if not self.live:
            return
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(
            f"\rversion {version + 1}/{self.versions} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done / MiB:7.0f}/{total / MiB:.0f} MiB"
        )
        sys.stderr.flush()

    def line(self, text: str) -> None:
        """Print one line that stays (over the bar on a terminal)."""
        if self.enabled:
            sys.stderr.write(("\r" if self.live else "") + text.ljust(70) + "\n")
            sys.stderr.flush()


def run_stream(
    args: argparse.Namespace, *, verify: bool, show: bool, engines: int = 1
) -> dict[str, Any]:
    """Run ``engines`` engine processes and one trainer; returns per-version figures.

    ``args`` carries ``size_mb``, ``tensors``, ``device`` (already resolved), ``versions``,
    ``timeout``, ``buffer_mb``, ``buffers`` and ``log_level``, which the children get too.
    ``committed`` lists, per version, what each engine reported (in engine order).
    """
    directory = make_private_dir()
    endpoints = [f"ipc://{directory / f'engine-{i}.sock'}" for i in range(engines)]
    common = [
        "--size-mb", str(args.size_mb),
        "--tensors", str(getattr(args, "tensors", 0)),
        "--device", args.device,
        "--versions", str(args.versions),
        "--timeout", str(args.timeout),
        "--log-level", args.log_level,
    ]  # fmt: skip
    progress = Progress(args.versions, show)
    synced: dict[int, dict[str, Any]] = {}
    committed: dict[int, list[dict[str, Any]]] = {}
    engine_rcs: list[int] = []
    try:
        with ExitStack() as stack:
            children = []
            for endpoint in endpoints:
                argv = [*common, "--endpoint", endpoint] + (["--verify"] if verify else [])
                engine = stack.enter_context(spawn("engine", argv))
                assert engine.stdout is not None
                engine_events = events(engine.stdout)
                ready = next(engine_events, None)
                if ready is None or ready.get("event") != "ready":
                    raise CommandError("an engine process exited before it was ready")
                children.append((engine, engine_events))
            trainer_argv = [
                *common, "--buffer-mb", str(args.buffer_mb), "--buffers", str(args.buffers)
            ]  # fmt: skip
            for endpoint in endpoints:
                trainer_argv += ["--endpoint", endpoint]
            with spawn("trainer", trainer_argv) as trainer:
                assert trainer.stdout is not None
                for event in events(trainer.stdout):
                    if event["event"] == "progress":
                        progress.update(event["version"], event["bytes"], event["total"])
                    elif event["event"] == "synced":
                        synced[event["version"]] = event
                        rate = event["bytes"] / event["seconds"] / 1e9
                        progress.line(
                            f"version {event['version']}: {event['bytes'] / 1e9:.2f} GB in "
                            f"{event['seconds']:.3f}s ({rate:.2f} GB/s)"
                        )
                trainer_rc = _wait(trainer, "trainer", args.timeout)
            for engine, engine_events in children:
                if trainer_rc != 0:  # the engine would wait for versions that never come
                    engine.terminate()
                for event in engine_events:
                    if event["event"] == "committed":
                        committed.setdefault(event["version"], []).append(event)
                engine_rcs.append(_wait(engine, "engine", args.timeout))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "trainer_rc": trainer_rc,
        "engine_rc": max(engine_rcs, default=1),
        "synced": [synced[v] for v in sorted(synced)],
        "committed": [committed[v] for v in sorted(committed)],
    }
