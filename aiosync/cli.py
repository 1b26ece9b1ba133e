"""The ``aiosync`` command: ``demo``, ``bench``, and the ``trainer`` / ``engine`` roles they spawn.

``demo`` starts an engine process and a trainer process on this machine, streams a
synthetic Llama-shaped model for several versions and checks each one bit-exact on the
engine. ``bench`` measures the same stream against a single-threaded memcpy and the simple
ways people move weights today. Roles talk to the parent through JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("aiosync.cli")

MiB = 1 << 20


def _emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, for the parent process."""
    print(json.dumps({"event": event, **fields}), flush=True)


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return name


# --- roles (run in child processes) -------------------------------------------------------


def _role_trainer(args: argparse.Namespace) -> int:
    import torch

    from aiosync.bench.model import synthetic_state_dict
    from aiosync.runtime import run
    from aiosync.sender import SenderConfig, WeightSender

    torch.set_num_threads(1)
    device = torch.device(args.device)
    weights = synthetic_state_dict(args.size_mb * MiB, device=device)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    config = SenderConfig(
        buffer_bytes=args.buffer_mb * MiB, num_buffers=args.buffers, timeout=args.timeout
    )

    async def main() -> None:
        async with WeightSender(args.endpoint, device=device, config=config) as sender:
            for version in range(args.versions):
                with torch.no_grad():
                    for tensor in weights.values():
                        tensor.add_(1.0)  # "a training step": the engine repeats it to verify
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                report = await sender.send(
                    weights.items(),
                    version=version,
                    progress=lambda p: _emit(
                        "progress", version=p.version, bytes=p.bytes, total=total
                    ),
                )
                _emit(
                    "synced",
                    version=report.version,
                    bytes=report.bytes,
                    tensors=report.tensors,
                    buckets=report.buckets,
                    seconds=report.seconds,
                )

    run(main)
    return 0


class _TimedSink:
    """Wraps a sink and adds up the seconds the engine spends applying and committing."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.busy = 0.0

    device = property(lambda self: self.inner.device)
    staged = property(lambda self: self.inner.staged)

    def check(self, spec: Any) -> None:
        self.inner.check(spec)

    def _timed(self, fn: Callable[..., None], *args: Any) -> None:
        started = time.perf_counter()
        try:
            fn(*args)
        finally:
            self.busy += time.perf_counter() - started

    def apply_bucket(self, items: Any) -> None:
        self._timed(self.inner.apply_bucket, items)

    def commit(self, version: int) -> None:
        self._timed(self.inner.commit, version)

    def abort(self) -> None:
        self.inner.abort()


def _role_engine(args: argparse.Namespace) -> int:
    import anyio
    import torch

    from aiosync.bench.model import synthetic_state_dict
    from aiosync.receiver import ReceiverConfig, WeightReceiver
    from aiosync.runtime import run
    from aiosync.sinks import ModuleSink

    torch.set_num_threads(1)
    device = torch.device(args.device)
    expected = synthetic_state_dict(args.size_mb * MiB, device=device)
    model = {name: torch.zeros_like(t) for name, t in expected.items()}
    sink = _TimedSink(ModuleSink(model))
    state = {"verified": -1, "bad": 0}
    all_verified = anyio.Event()

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
        _emit("committed", version=version, verified=ok, engine_seconds=busy)
        if version == args.versions - 1:
            anyio.from_thread.run_sync(all_verified.set)

    async def main() -> None:
        config = ReceiverConfig(stream_timeout=args.timeout)
        async with WeightReceiver(sink, args.endpoint, config=config, on_commit=verify) as rx:
            _emit("ready", endpoint=rx.endpoint)
            if not args.versions:
                await anyio.sleep_forever()
            with anyio.fail_after(args.timeout * args.versions):
                await all_verified.wait()

    run(main)
    return 1 if state["bad"] else 0


# --- parent side ---------------------------------------------------------------------------


@contextmanager
def _spawn(role: str, argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """Start ``aiosync <role>`` as a child; it is killed on the way out if still running."""
    from aiosync.runtime import child_env, stop_process

    proc = subprocess.Popen(
        [sys.executable, "-m", "aiosync.cli", role, *argv],
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


def _events(stream: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stream:
        line = line.strip()
        if line.startswith("{"):
            yield json.loads(line)


class _Progress:
    """Progress on stderr: a live bar on a terminal, one line per version otherwise."""

    def __init__(self, versions: int, enabled: bool) -> None:
        self.versions = versions
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()

    def update(self, version: int, done: int, total: int) -> None:
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
        if self.enabled:
            sys.stderr.write(("\r" if self.live else "") + text.ljust(70) + "\n")
            sys.stderr.flush()


def run_stream(args: argparse.Namespace, *, verify: bool, show: bool) -> dict[str, Any]:
    """Run one engine and one trainer process; returns per-version figures from both."""
    directory = Path(tempfile.mkdtemp(prefix="aiosync-"))
    endpoint = f"ipc://{directory / 'engine.sock'}"
    common = [
        "--endpoint", endpoint,
        "--size-mb", str(args.size_mb),
        "--device", _resolve_device(args.device),
        "--versions", str(args.versions),
        "--timeout", str(args.timeout),
    ]  # fmt: skip
    progress = _Progress(args.versions, show)
    synced: dict[int, dict[str, Any]] = {}
    committed: dict[int, dict[str, Any]] = {}
    try:
        engine_argv = common + (["--verify"] if verify else [])
        with _spawn("engine", engine_argv) as engine:
            assert engine.stdout is not None
            engine_events = _events(engine.stdout)
            ready = next(engine_events, None)
            if ready is None or ready.get("event") != "ready":
                raise RuntimeError("engine process exited before it was ready")
            trainer_argv = [
                *common, "--buffer-mb", str(args.buffer_mb), "--buffers", str(args.buffers)
            ]  # fmt: skip
            with _spawn("trainer", trainer_argv) as trainer:
                assert trainer.stdout is not None
                for event in _events(trainer.stdout):
                    if event["event"] == "progress":
                        progress.update(event["version"], event["bytes"], event["total"])
                    elif event["event"] == "synced":
                        synced[event["version"]] = event
                        rate = event["bytes"] / event["seconds"] / 1e9
                        progress.line(
                            f"version {event['version']}: {event['bytes'] / 1e9:.2f} GB in "
                            f"{event['seconds']:.3f}s ({rate:.2f} GB/s)"
                        )
                trainer_rc = trainer.wait(timeout=args.timeout)
            if trainer_rc != 0:  # the engine would wait for versions that never come
                engine.terminate()
            for event in engine_events:
                if event["event"] == "committed":
                    committed[event["version"]] = event
            engine_rc = engine.wait(timeout=args.timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "trainer_rc": trainer_rc,
        "engine_rc": engine_rc,
        "synced": [synced[v] for v in sorted(synced)],
        "committed": [committed[v] for v in sorted(committed)],
    }


def _cmd_demo(args: argparse.Namespace) -> int:
    show = not args.quiet
    if show:
        print(
            f"aiosync demo: {args.size_mb} MiB fp32 Llama-shaped model, {args.versions} versions, "
            f"device {_resolve_device(args.device)}",
            file=sys.stderr,
        )
    result = run_stream(args, verify=True, show=show)
    versions = [c["version"] for c in result["committed"] if c["verified"]]
    ok = (
        result["trainer_rc"] == 0
        and result["engine_rc"] == 0
        and versions == list(range(args.versions))
    )
    summary = {
        "ok": ok,
        "versions_verified": versions,
        "bytes_per_version": result["synced"][0]["bytes"] if result["synced"] else 0,
        "seconds": [s["seconds"] for s in result["synced"]],
    }
    if args.json:
        print(json.dumps(summary))
    elif show:
        verdict = "bit-exact" if ok else "FAILED"
        print(f"{len(versions)}/{args.versions} versions {verdict} on the engine", file=sys.stderr)
        print(
            "(times include the engine checking the previous version; `aiosync bench` "
            "measures throughput)",
            file=sys.stderr,
        )
    return 0 if ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from aiosync.bench import baselines, floors, model

    show = not args.quiet
    nbytes_target = args.size_mb * MiB
    device = _resolve_device(args.device)
    memcpy = floors.measure_memcpy(min(nbytes_target, 1 << 30))
    if show:
        print(f"memcpy (1 thread): {memcpy:.2f} GB/s", file=sys.stderr)
    gpu_copy = None
    if device.startswith("cuda"):
        gpu_copy = floors.measure_device_copy(nbytes_target, device)
        if show:
            print(f"GPU copy on {device}: {gpu_copy:.1f} GB/s", file=sys.stderr)
    args.versions = args.repeats + 1  # the first version warms up buffers and page tables
    result = run_stream(args, verify=False, show=show)
    if result["trainer_rc"] or result["engine_rc"] or len(result["synced"]) != args.versions:
        print("aiosync stream failed", file=sys.stderr)
        return 1
    timed = result["synced"][1:]
    seconds = statistics.median(s["seconds"] for s in timed)
    nbytes = timed[0]["bytes"]
    engine = statistics.median(c["engine_seconds"] for c in result["committed"][1:])
    out: dict[str, Any] = {
        "bytes": nbytes,
        "seconds": seconds,
        "GBps": nbytes / seconds / 1e9,
        "memcpy_GBps": memcpy,
        "ratio_to_memcpy": memcpy / (nbytes / seconds / 1e9),
        "trainer_seconds": seconds,
        "engine_seconds": engine,
        "device": device,
        "buffers": args.buffers,
        "buffer_mb": args.buffer_mb,
    }
    if gpu_copy is not None:
        out["gpu_copy_GBps"] = gpu_copy
        out["ratio_to_gpu_copy"] = gpu_copy / out["GBps"]
    if not args.skip_baselines:
        state = model.synthetic_state_dict(nbytes_target)
        out["torch_save_zmq"] = baselines.measure_torch_save_zmq(state, repeats=args.repeats)
        out["safetensors_shm"] = baselines.measure_safetensors_shm(state, repeats=args.repeats)
        del state
    if show:
        print(f"aiosync shm stream: {out['GBps']:.2f} GB/s", file=sys.stderr)
        for key in ("torch_save_zmq", "safetensors_shm"):
            if key in out:
                print(f"{key}: {out[key]['GBps']:.2f} GB/s", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiosync", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, size_mb: int) -> None:
        p.add_argument("--size-mb", type=int, default=size_mb, help="model size in MiB")
        p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds per wait on a peer")

    def pipeline(p: argparse.ArgumentParser) -> None:
        p.add_argument("--buffers", type=int, default=2, help="shared buffers (in flight)")
        p.add_argument("--buffer-mb", type=int, default=128, help="MiB per buffer")

    demo = sub.add_parser("demo", help="stream a synthetic model trainer -> engine and verify it")
    common(demo, 1024)
    pipeline(demo)
    demo.add_argument("--versions", type=int, default=3)
    demo.add_argument("--json", action="store_true", help="print a JSON summary as last line")
    demo.add_argument("--quiet", action="store_true", help="no progress on stderr")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="measure the stream against memcpy and simple ways")
    common(bench, 1024)
    pipeline(bench)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--skip-baselines", action="store_true")
    bench.add_argument("--json", action="store_true", help="print a JSON result as last line")
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")
    bench.set_defaults(func=_cmd_bench)

    for role, func in (("trainer", _role_trainer), ("engine", _role_engine)):
        p = sub.add_parser(role, help=f"run the {role} side (JSON lines on stdout)")
        common(p, 1024)
        p.add_argument("--endpoint", required=True)
        p.add_argument("--versions", type=int, default=3, help="versions to stream (0: forever)")
        if role == "trainer":
            pipeline(p)
        else:
            p.add_argument("--verify", action="store_true", help="check each version bit-exact")
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aiosync`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
