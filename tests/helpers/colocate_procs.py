"""Start-up and teardown shared by the colocated drivers (colocate_gpu, colocate_pipeline_gpu).

Each of those scripts runs as a driver that starts itself again as one engine process
(``--role engine``) and two trainer ranks (``--role trainer``) in a Gloo world over loopback,
reads the JSON lines they print, and at the end stops and reaps every one of them. What an
engine checks and what the trainers send stays in each script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

Line = dict[str, Any]
"""One JSON object a child printed on a line of its stdout."""


def role_parser(
    doc: str | None, *, versions: int, versions_help: str | None = None
) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with the options every role shares.

    They are ``--role`` (drive, engine or trainer; drive by default), ``--rank``, ``--store``,
    ``--endpoint`` and ``--versions`` (``versions`` by default), in that order; the caller
    adds its own options after them.
    """
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--role", choices=["drive", "engine", "trainer"], default="drive")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--store", default="")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--versions", type=int, default=versions, help=versions_help)
    return parser


def skip_without_two_gpus(tiny: bool) -> bool:
    """True, after printing a ``{"skipped": ...}`` line, when a run on GPUs has fewer than two.

    A ``tiny`` run is on the CPU and is never skipped.
    """
    if not tiny and torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": "needs two CUDA devices"}), flush=True)
        return True
    return False


def loopback_env() -> dict[str, str]:
    """The environment for the children: aiosync's ``child_env`` with Gloo on loopback.

    ``GLOO_SOCKET_IFNAME`` is ``lo`` unless it is already set: every rank is on this host.
    """
    from aiosync.runtime import child_env

    env = child_env()
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _read_lines(proc: subprocess.Popen[str], put: Callable[[Line], object], tag: str) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        try:
            put(json.loads(raw))
        except json.JSONDecodeError:
            print(f"[{tag}] {raw.rstrip()}", file=sys.stderr, flush=True)


def _reader(
    proc: subprocess.Popen[str], put: Callable[[Line], object], tag: str
) -> threading.Thread:
    reader = threading.Thread(target=_read_lines, args=(proc, put, tag), daemon=True)
    reader.start()
    return reader


class Children:
    """A driver's children: ``python -m module *argv --role ...``, each with stdout piped.

    Each child's stdout is read by a daemon thread that hands every JSON line to the ``put``
    given when it was started and echoes any other line to stderr as ``[tag] line``. Used as
    a context manager: on leaving the block, however it is left, every child's stdin is
    closed, then every child is stopped and reaped (``stop_process`` with 10 seconds' grace,
    in the order they were started), then the directories made by :meth:`store` are removed.
    """

    def __init__(self, module: str, *argv: str, env: dict[str, str]) -> None:
        self.command = [sys.executable, "-m", module, *argv]
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []
        self.trainers: list[subprocess.Popen[str]] = []
        self.scratch: list[str] = []

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        from aiosync.runtime import stop_process

        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs:
            stop_process(proc, grace=10)
        for scratch in self.scratch:
            shutil.rmtree(scratch, ignore_errors=True)

    def start_engine(self, put: Callable[[Line], object]) -> subprocess.Popen[str]:
        """Starts ``--role engine`` with its stdin piped too, and a reader passing lines to put.

        The engine serves until its stdin is closed, which leaving the block does.
        """
        engine = subprocess.Popen(
            [*self.command, "--role", "engine"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        self.procs.append(engine)
        _reader(engine, put, "engine")
        return engine

    def store(self) -> str:
        """A path for a Gloo file store, in a new temporary directory removed at the end."""
        scratch = tempfile.mkdtemp(prefix="aiosync-colocate-")
        self.scratch.append(scratch)
        return os.path.join(scratch, "store")

    def start_trainers(
        self,
        store: str,
        endpoint: str,
        versions: int,
        put: Callable[[Line], object],
        *extra: str,
    ) -> list[threading.Thread]:
        """Starts ranks 0 and 1 of ``--role trainer``, each with a reader passing lines to put.

        Rank r's options are ``--rank r --store store --endpoint endpoint --versions versions``
        and then ``extra``. Returns the two readers, rank 0's first.
        """
        readers = []
        for rank in range(2):
            args = ["--role", "trainer", "--rank", str(rank), "--store", store]
            args += ["--endpoint", endpoint, "--versions", str(versions), *extra]
            proc = subprocess.Popen(
                [*self.command, *args], stdout=subprocess.PIPE, text=True, env=self.env
            )
            self.procs.append(proc)
            self.trainers.append(proc)
            readers.append(_reader(proc, put, f"rank {rank}"))
        return readers

    def wait_trainers(self, readers: list[threading.Thread], deadline: float) -> list[int]:
        """The trainers' exit codes, rank 0's first, once each has exited and been read.

        Each trainer is waited for until ``deadline`` (a :func:`time.monotonic` time), but
        at least a second; then each reader is given 10 seconds to read what is left.
        Raises :class:`subprocess.TimeoutExpired` when a trainer is still running.
        """
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in self.trainers]
        for reader in readers:
            reader.join(timeout=10)
        return codes
