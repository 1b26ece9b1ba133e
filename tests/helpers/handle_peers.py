"""Engine processes for the handle tests: started, read line by line, always reaped."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from aiosync.runtime import child_env, stop_process

GUARD = 60.0  # seconds: a hang guard only, never a measured bound
ROOT = Path(__file__).resolve().parents[2]


class EngineProcess:
    """A running ``tests.helpers.handle_engine`` and the JSON events it printed."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.endpoint = ""

    def ready(self) -> EngineProcess:
        """Wait for the engine's ``ready`` line; return self."""
        self.endpoint = self.wait_for("ready")["endpoint"]
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def wait_for(self, event: str, **match: object) -> dict[str, Any]:
        """The next event of kind ``event`` whose fields match (earlier others are kept)."""
        for seen in self.seen:
            if seen["event"] == event and all(seen.get(k) == v for k, v in match.items()):
                self.seen.remove(seen)
                return seen
        while True:
            try:
                item = self.events.get(timeout=GUARD)
            except queue.Empty:
                raise AssertionError(f"no {event} {match} from the engine") from None
            if item is None:
                raise AssertionError(f"engine exited ({self.proc.poll()}) before {event}")
            if item["event"] == event and all(item.get(k) == v for k, v in match.items()):
                return item
            self.seen.append(item)

    def drain(self) -> list[dict[str, Any]]:
        """Every event printed so far and not yet taken."""
        out, self.seen = self.seen, []
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                out.append(item)


@contextmanager
def engine_process(*args: str) -> Iterator[EngineProcess]:
    """``python -m tests.helpers.handle_engine ARGS``, ready; its stdin is closed, it is reaped."""
    with _started(*args) as engine:
        yield engine.ready()


@contextmanager
def engine_processes(*argsets: tuple[str, ...]) -> Iterator[list[EngineProcess]]:
    """One engine per argument tuple, started at once (their imports overlap), all ready."""
    with ExitStack() as stack:
        engines = [stack.enter_context(_started(*args)) for args in argsets]
        yield [engine.ready() for engine in engines]


@contextmanager
def _started(*args: str) -> Iterator[EngineProcess]:
    env = child_env()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.handle_engine", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        yield EngineProcess(proc)
    finally:
        if proc.stdin is not None:
            with suppress(OSError):
                proc.stdin.close()
        stop_process(proc, grace=10)
        if proc.stdout is not None:
            proc.stdout.close()
