"""The ``trainer`` and ``engine`` roles: the two processes ``demo`` and ``bench`` start.

Each role reports to its parent as JSON lines on stdout (``{"event": ..., ...}``), one per
step, and logs through :mod:`logging` on stderr. Both use only aiosync's public API.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiosync.cli.checks import CommandError, MiB

log = logging.getLogger("aiosync.cli")


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, for the parent process."""
    print(json.dumps({"event": event, **fields}), flush=True)


def run_role(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a role's coroutine; SIGTERM or SIGINT cancels it, so it unwinds inside the loop.

    Cancelling the coroutine lets every ``async with`` close in order (sockets, shared
    memory, the private directory of a default endpoint), which an exception raised at a
    random point of the event loop would not. Then the signal ends the process as
    :func:`aiosync.cli.main` arranges: ``SystemExit(143)`` for SIGTERM, ``KeyboardInterrupt``
    for SIGINT. A second signal meets the default action.
    """
    from aiosync.runtime import run

    received: list[int] = []

    async def guarded() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_signal(signum: int) -> None:
            received.append(signum)
            for each in _SIGNALS:
                loop.remove_signal_handler(each)
            task.cancel()

        for signum in _SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
        await main()

    try:
        run(guarded)
    except asyncio.CancelledError:
        if not received:
            raise
    if received:
        if received[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + received[0])


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class LoopWatch:
    """A 1 ms heartbeat on the event loop, to measure stalls.

    The longest gap between beats is the longest time the loop could not run anything.
    """

    def __init__(self) -> None:
        self._longest = 0.0

    async def run(self) -> None:
        """Beat until cancelled."""
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self._longest = max(self._longest, now - last)
            last = now

    def take(self) -> float:
        """The longest stall, in milliseconds, since the last call."""
        longest, self._longest = self._longest, 0.0
        return longest * 1e3


def channel_auth(args: argparse.Namespace) -> Any:
    """The role's channel keys, from ``--keypair`` with ``--allow`` or ``--server-key``.

    ``--insecure-loopback`` alone allows plain tcp on loopback; with none of them, None
    (the default ``ipc://`` needs no keys).
    """
    from aiosync.channels.keys import ChannelAuth

    if args.keypair:
        allow = getattr(args, "allow", None)
        if allow is not None:
            return ChannelAuth.server(args.keypair, allow)
        server_key = getattr(args, "server_key", None)
        if server_key is None:
            raise CommandError("--keypair needs --allow (engine) or --server-key (trainer)")
        return ChannelAuth.client(args.keypair, server_key)
    if args.insecure_loopback:
        return ChannelAuth(insecure_loopback=True)
    return None


def trainer(args: argparse.Namespace) -> int:
    """Send ``args.versions`` versions (0: until stopped) of a synthetic model to every engine."""
    import torch

    from aiosync import SenderConfig, WeightSender
    from aiosync.bench.model import bench_state_dict

    torch.set_num_threads(1)
    device = torch.device(args.device)
    weights = bench_state_dict(args.size_mb * MiB, args.tensors, device=device)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    config = SenderConfig(
        buffer_bytes=int(args.buffer_mb * MiB), num_buffers=args.buffers, timeout=args.timeout
    )
    versions = itertools.count() if args.versions == 0 else range(args.versions)

    def training_step() -> None:
        with torch.no_grad():
            for tensor in weights.values():
                tensor.add_(1.0)  # the engine repeats it to verify
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    async def main() -> None:
        watch = LoopWatch()
        async with (
            WeightSender(
                args.endpoint, device=device, config=config, auth=channel_auth(args)
            ) as sender,
            asyncio.TaskGroup() as tasks,
        ):
            beating = tasks.create_task(watch.run())
            for version in versions:
                await asyncio.to_thread(training_step)
                watch.take()
                report = await sender.send(
                    weights.items(),
                    version=version,
                    progress=lambda p: emit(
                        "progress", version=p.version, bytes=p.bytes, total=total
                    ),
                )
                log.info("trainer: sent version %d to %s", version, ", ".join(args.endpoint))
                emit(
                    "synced",
                    version=report.version,
                    bytes=report.bytes,
                    tensors=report.tensors,
                    buckets=report.buckets,
                    seconds=report.seconds,
                    engines=len(report.committed),
                    stall_ms=watch.take(),
                )
            beating.cancel()

    run_role(main)
    return 0


class _TimedSink:
    """Passes everything to a sink and adds up the seconds it spends applying and committing."""

    TIMED = frozenset({"apply_bucket", "commit"})

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.busy = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.TIMED or not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - started

        return timed


class NoVersionError(Exception):
    """The engine waited longer than its timeout for the next version."""


def engine(args: argparse.Namespace) -> int:
    """Receive versions of a synthetic model; exit 1 if one fails its check or never comes."""
    import torch

    from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
    from aiosync.bench.model import bench_state_dict

    torch.set_num_threads(1)
    device = torch.device(args.device)
    expected = bench_state_dict(args.size_mb * MiB, args.tensors, device=device)
    model = {name: torch.zeros_like(t) for name, t in expected.items()}
    sink = _TimedSink(ModuleSink(model))
    state = {"verified": -1, "bad": 0}
    watch = LoopWatch()

    def verify(version: int) -> None:
        """Repeat the trainer's step on the expected copy and compare (a worker thread)."""
        busy, sink.busy = sink.busy, 0.0
        ok = version == state["verified"] + 1
        if ok and args.verify:
            with torch.no_grad():
                for tensor in expected.values():
                    tensor.add_(1.0)
            ok = all(torch.equal(model[name], tensor) for name, tensor in expected.items())
        state["verified"] = version
        state["bad"] += 0 if ok else 1
        log.info("engine: version %d committed%s", version, " and verified" if ok else ", BAD")
        emit(
            "committed",
            version=version,
            verified=ok,
            engine_seconds=busy,
            stall_ms=watch.take(),
        )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        committed: asyncio.Queue[int] = asyncio.Queue()

        def on_commit(version: int) -> None:
            verify(version)
            loop.call_soon_threadsafe(committed.put_nowait, version)

        config = ReceiverConfig(stream_timeout=args.timeout)
        async with (
            WeightReceiver(
                sink, args.endpoint, config=config, on_commit=on_commit, auth=channel_auth(args)
            ) as rx,
            asyncio.TaskGroup() as tasks,
        ):
            beating = tasks.create_task(watch.run())
            emit("ready", endpoint=rx.endpoint)
            await _wait_for_versions(committed, rx.endpoint, args.versions, args.timeout)
            beating.cancel()

    run_role(main)
    return 1 if state["bad"] else 0


async def _wait_for_versions(
    committed: asyncio.Queue[int], endpoint: str, versions: int, timeout: float
) -> None:
    """Return once version ``versions - 1`` is committed (never when ``versions`` is 0)."""
    wait = math.inf if versions == 0 else timeout
    next_version = 0
    while versions == 0 or next_version < versions:
        try:
            version = await asyncio.wait_for(committed.get(), None if wait == math.inf else wait)
        except TimeoutError:
            after = "" if next_version == 0 else f" after version {next_version - 1}"
            raise NoVersionError(
                f"engine at {endpoint}: no version {next_version} from any trainer within "
                f"{timeout:g}s{after}"
            ) from None
        next_version = version + 1


ROLES: dict[str, Callable[[argparse.Namespace], int]] = {"trainer": trainer, "engine": engine}

__all__ = ["ROLES", "LoopWatch", "NoVersionError", "emit", "engine", "trainer"]
