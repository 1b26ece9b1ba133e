"""One bucket's trip through the package's files: ``python -m benchmarks.trip``.

A trainer (:class:`~aiosync.WeightSender`, this process) sends a small module, whose
version is one bucket, to an engine (:class:`~aiosync.WeightReceiver` with a
:class:`~aiosync.ModuleSink`) in a process of its own, three versions in a row; the third
(after two warm-ups: layouts kept, the early begin in use) is traced. In each process a
profile hook (``sys.setprofile`` and ``threading.setprofile``, installed before any worker
thread starts, so the threads that read, pack and apply are traced too) notes every file
of ``aiosync/`` that runs code between two markers, seen by the hook itself:

- **trainer**: from the call of ``WeightSender.send`` (its code object) to the call that
  hands the bucket's message to the channel (a ``send`` of ``aiosync/channels/`` whose
  payload decodes to the version's ``bucket``). Where bucket 1 went inside the early
  ``begin``, ahead of the read (a CUDA ring bucket behind a counter, a kept direct
  bucket), its read and packing come after that hand-off: the trace then ends at the
  next hand-off, the ``complete``, which follows the packed bucket without waiting for acks.
- **engine**: from the first call into ``aiosync/channels/`` code given the bytes of the
  traced version's ``begin`` (the listener taking the message off its socket) to the
  return of the sink's ``apply_with`` (its code object): the copy into the parameters
  (on CUDA, queued on the stream).

A file counts once code of it runs (a call, a return or a coroutine resumed); each
function is listed with its calls (a coroutine's or generator's resumptions apart).
Keepalives and session expiry are set far beyond the run, so nothing periodic runs in
between. Prints the files of each process in the order first seen and the union's count;
``--json`` prints one JSON object instead. ``--device cuda`` sends from and to ``cuda:0``
(one GPU is enough: both processes use it).
"""

from __future__ import annotations

import argparse
import dis
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import anyio
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aiosync"
CHANNELS = "aiosync/channels/"
VERSIONS = 3
"""Versions sent; the last is traced (the ones before warm the layouts and the guess)."""
QUIET = 3600.0
"""Seconds of keepalive and session timeouts: nothing periodic fires during a run."""
GENERATORS = 0x20 | 0x80 | 0x100 | 0x200  # CO_GENERATOR, CO_COROUTINE, ..._ITERABLE, ASYNC_GEN

Marker = Callable[[FrameType, str, object], bool]


def message_of(frame: FrameType) -> object | None:
    """The wire message a call's first bytes argument decodes to, or None."""
    from aiosync.core.wire import decode

    code = frame.f_code
    for name in code.co_varnames[: code.co_argcount]:
        value = frame.f_locals.get(name)
        if isinstance(value, bytes | memoryview):
            try:
                return decode(value)
            except Exception:
                return None
    return None


class TripTrace:
    """The package files that run code in this process between ``starts`` and ``stops``.

    Both markers are seen by the hook: each gets every call and return event (frame, event,
    argument) until it answers True; the start's event is recorded, and so is the stop's.
    """

    def __init__(self, starts: Marker, stops: Marker) -> None:
        self.starts = starts
        self.stops = stops
        self.started = False
        self.stopped = False
        self.files: dict[str, dict[str, list[int]]] = {}
        """file (from the repository root) -> function -> [calls, resumptions]"""
        self._paths: dict[str, str | None] = {}
        self._entry: dict[CodeType, int] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        """Trace this thread and every thread started from now on."""
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)

    def uninstall(self) -> None:
        """Stop tracing (threads started meanwhile keep a hook that does nothing)."""
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def _hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" and event != "return":
            return
        if not self.started:
            if self.stopped or not self.starts(frame, event, arg):
                return
            self.started = True
        elif self.stopped:
            return
        code = frame.f_code
        path = self._path(code.co_filename)
        if path is not None:
            with self._lock:
                counts = self.files.setdefault(path, {}).setdefault(code.co_qualname, [0, 0])
                if event == "call":
                    counts[0 if self._fresh(frame) else 1] += 1
        if self.stops(frame, event, arg):
            self.stopped = True

    def _path(self, filename: str) -> str | None:
        known = self._paths.get(filename, "")
        if known != "":
            return known
        resolved = Path(filename).resolve()
        path = str(resolved.relative_to(ROOT)) if resolved.is_relative_to(PACKAGE) else None
        self._paths[filename] = path
        return path

    def _fresh(self, frame: FrameType) -> bool:
        """Whether a call event starts the frame (not a generator or coroutine resumed)."""
        code = frame.f_code
        if not code.co_flags & GENERATORS:
            return True
        entry = self._entry.get(code)
        if entry is None:
            resumes = [i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"]
            entry = self._entry[code] = resumes[0] if resumes else -1
        return frame.f_lasti <= entry

    def report(self, process: str) -> dict[str, Any]:
        """The trace as JSON-ready data (files in the order first seen)."""
        files = [
            {
                "file": path,
                "calls": {name: n[0] for name, n in functions.items()},
                "resumed": {name: n[1] for name, n in functions.items() if n[1]},
            }
            for path, functions in self.files.items()
        ]
        return {
            "process": process,
            "complete": self.started and self.stopped,
            "files": files,
            "count": len(files),
            "functions": sum(len(f["calls"]) for f in files),
        }


def in_channels(frame: FrameType) -> bool:
    """Whether the frame runs code of ``aiosync/channels/``."""
    return f"/{CHANNELS}" in frame.f_code.co_filename.replace("\\", "/")


class TrainerMarkers:
    """The trainer's markers: ``send``'s call, and the bucket's hand-off to the channel."""

    def __init__(self) -> None:
        from aiosync import WeightSender

        self.send = WeightSender.send.__code__
        self.armed = False  # set just before the traced version's send
        self.ahead = False  # bucket 1 went inside the begin: the next hand-off ends it
        self.stopped_at = ""

    def starts(self, frame: FrameType, event: str, arg: object) -> bool:
        """The call of ``WeightSender.send``, once armed."""
        return self.armed and event == "call" and frame.f_code is self.send

    def stops(self, frame: FrameType, event: str, arg: object) -> bool:
        """A channel's ``send`` of the bucket (or of the message after a bucket sent ahead)."""
        if event != "call" or frame.f_code.co_name != "send" or not in_channels(frame):
            return False
        message = message_of(frame)
        kind = type(message).__name__.lower()
        if self.ahead or kind == "bucket":
            self.stopped_at = f"the channel's send of the {kind}"
            return True
        if kind == "begin" and getattr(message, "first", None) is not None:
            self.ahead = True  # read and packed after: the complete follows them
        return False


class EngineMarkers:
    """The engine's markers: the traced version's begin received, the sink's apply returned."""

    def __init__(self, version: int, apply: CodeType) -> None:
        self.version = version
        self.apply = apply

    def starts(self, frame: FrameType, event: str, arg: object) -> bool:
        """The first call into channel code given the bytes of the traced version's begin."""
        if event != "call" or not in_channels(frame):
            return False
        message = message_of(frame)
        version = getattr(message, "version", None)
        return type(message).__name__ == "Begin" and version == self.version

    def stops(self, frame: FrameType, event: str, arg: object) -> bool:
        """The return of the sink's ``apply_with``."""
        return event == "return" and frame.f_code is self.apply


def small_model(device: str) -> torch.nn.Module:
    """Two linear layers: four tensors, one bucket."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model.to(device).requires_grad_(False)


def emit(event: str, **fields: object) -> None:
    """One JSON line on stdout, for the process that started this one."""
    print(json.dumps({"event": event, **fields}), flush=True)


def engine(device: str) -> None:
    """Serve on a private endpoint; print ``ready``, then ``trace`` once the last commits."""
    from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
    from aiosync.runtime import run

    model = small_model(device)
    sink = ModuleSink(model)
    markers = EngineMarkers(VERSIONS - 1, type(sink).apply_with.__code__)
    trace = TripTrace(markers.starts, markers.stops)

    def committed(version: int) -> None:
        if version == VERSIONS - 1:
            emit("trace", **trace.report("engine"))

    async def serve() -> None:
        config = ReceiverConfig(session_timeout=QUIET, stream_timeout=QUIET)
        async with WeightReceiver(sink, config=config, on_commit=committed) as receiver:
            emit("ready", endpoint=receiver.endpoint)
            await anyio.sleep_forever()

    trace.install()  # before the receiver starts a thread
    run(serve)


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[dict[str, Any]]:
    """The child's JSON lines as they come (a reader thread started before any hook)."""
    out: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                out.put(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return out


def next_event(events: queue.Queue[dict[str, Any]], kind: str, timeout: float) -> dict[str, Any]:
    """The child's next event of ``kind`` (those before it are dropped)."""
    while True:
        try:
            event = events.get(timeout=timeout)
        except queue.Empty:
            raise SystemExit(f"the engine sent no {kind!r} within {timeout:g}s") from None
        if event["event"] == kind:
            return event


def measure(device: str = "cpu", timeout: float = 120.0) -> dict[str, Any]:
    """Trace one bucket's trip in both processes; both reports and the union's count."""
    from aiosync import SenderConfig, WeightSender
    from aiosync.runtime import child_env, run, stop_process

    argv = [sys.executable, "-m", "benchmarks.trip", "--engine", "--device", device]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    try:
        events = lines_of(proc)
        endpoint = next_event(events, "ready", timeout)["endpoint"]
        model = small_model(device)
        markers = TrainerMarkers()
        trace = TripTrace(markers.starts, markers.stops)

        async def main() -> None:
            config = SenderConfig(buffer_bytes=1 << 20, keepalive=QUIET, timeout=timeout)
            async with WeightSender(endpoint, device=device, config=config) as sender:
                for version in range(VERSIONS):
                    markers.armed = version == VERSIONS - 1
                    await sender.send(model, version=version)

        trace.install()  # before the sender starts a thread
        try:
            run(main)
        finally:
            trace.uninstall()
        trainer = trace.report("trainer") | {"stop": markers.stopped_at}
        engine_side = next_event(events, "trace", timeout)
        engine_side.pop("event")
    finally:
        stop_process(proc, 5.0)
        if proc.stdout is not None:
            proc.stdout.close()
    union = {f["file"] for side in (trainer, engine_side) for f in side["files"]}
    return {
        "device": device,
        "trainer": trainer,
        "engine": engine_side,
        "union": len(union),
        "union_files": sorted(union),
    }


def named(function: str, calls: int, resumed: int) -> str:
    """A function as the text lists it: ``f``, ``f x3``, ``f x2 +1 resumed``, ``f (resumed x2)``."""
    if not calls:
        return f"{function} (resumed x{resumed})" if resumed else f"{function} (running)"
    text = function if calls == 1 else f"{function} x{calls}"
    return f"{text} +{resumed} resumed" if resumed else text


def render(trip: dict[str, Any]) -> str:
    """The trip as text: each process's files in order, with the functions that ran."""
    lines = [f"one bucket's trip on {trip['device']}: {trip['union']} files in both processes"]
    for side in (trip["trainer"], trip["engine"]):
        done = "" if side["complete"] else " (INCOMPLETE: a marker was not seen)"
        lines.append(
            f"{side['process']}: {side['count']} files, {side['functions']} functions{done}"
        )
        for i, entry in enumerate(side["files"], 1):
            calls = ", ".join(
                named(name, n, entry["resumed"].get(name, 0)) for name, n in entry["calls"].items()
            )
            lines.append(f"  {i:2}. {entry['file']}: {calls}")
    return "\n".join(lines)


def main() -> None:
    """Parse the command line, trace, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device")
    if args.engine:
        engine(args.device)
        return
    trip = measure(args.device)
    print(json.dumps(trip, indent=1) if args.json else render(trip), flush=True)
    if not (trip["trainer"]["complete"] and trip["engine"]["complete"]):
        raise SystemExit("a marker was not seen: the trace is incomplete")


if __name__ == "__main__":
    main()
