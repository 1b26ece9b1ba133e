"""The server benchmark (issue 12): one publisher, N subscriber processes, V versions.

Run: ``python -m tests.helpers.server_bench --size-mb 256 --versions 20 --engines 8``. In one run
it measures, on this machine:

1. the publisher's seconds per version straight to one engine process (the baseline);
2. per version into ``aiosync serve`` with N subscribers connected but not copying;
3. per version under full fan-out (every subscriber follows the newest);
4. a late joiner's seconds from subscribing to the newest version;
5. the server's peak memory (VmHWM) and shared memory held (RssShmem);
6. a relay pulling one version from a server over loopback tcp, beside raw ZMQ tcp
   (PUSH/PULL, 4 MiB messages) carrying the same bytes between two processes;

and checks every subscriber ends on the newest version bit-exact (digests). Prints one
JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from aiosync import SenderConfig, WeightSender
from aiosync.bench.model import synthetic_state_dict, tensor_digest
from aiosync.channels.keys import ChannelAuth
from aiosync.runtime import run
from aiosync.server import RetentionPolicy, ServerClient
from aiosync.server.relay import Relay
from aiosync.server.store import RetentionStore

ROOT = Path(__file__).resolve().parents[2]
WAIT = 600.0
RELAY_VERSIONS = 5


def spawn(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def note(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


async def event(proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    note(f"waiting for {kind} from {proc.pid}")
    assert proc.stdout is not None
    with anyio.fail_after(WAIT):
        while True:
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
            if not line:
                raise RuntimeError(f"process {proc.args} exited with {proc.poll()}")
            found = json.loads(line)
            if found.get("event") == kind:
                return found


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssShmem", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def step(model: dict[str, torch.Tensor], version: int) -> None:
    """A cheap training step: one element of every tensor says the version."""
    for tensor in model.values():
        tensor.view(-1)[0] = float(version)


async def timed(
    sender: WeightSender, model: dict[str, torch.Tensor], versions: range
) -> list[float]:
    seconds = []
    for version in versions:
        step(model, version)
        started = time.perf_counter()
        await sender.send(model, version=version)
        seconds.append(time.perf_counter() - started)
    return seconds


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = int(args.size_mb * (1 << 20))
    model = synthetic_state_dict(nbytes)
    config = SenderConfig(buffer_bytes=args.buffer_mb << 20, num_buffers=2, timeout=WAIT)
    procs: list[subprocess.Popen[str]] = []
    out: dict[str, Any] = {"size_mb": args.size_mb, "engines": args.engines}
    try:
        # 1. the baseline: one engine process, straight from the trainer
        engine = spawn(
            "-m",
            "aiosync",
            "engine",
            "--device",
            "cpu",
            "--size-mb",
            str(args.size_mb),
            "--versions",
            "0",
        )
        procs.append(engine)
        endpoint = (await event(engine, "ready"))["endpoint"]
        async with WeightSender(endpoint, config=config) as sender:
            direct = (await timed(sender, model, range(args.baseline + 1)))[1:]
        engine.terminate()
        out["direct_s"] = statistics.median(direct)
        out["direct_min_s"] = min(direct)

        # 2. the server with N subscribers connected but not copying
        server = spawn("-m", "aiosync", "serve", "--retain", "2", "--timeout", str(WAIT))
        procs.append(server)
        ready = await event(server, "ready")
        control, publish = ready["control"], ready["publish"]
        subs = []
        for i in range(args.engines):
            sub = spawn(
                "-m",
                "tests.helpers.server_engine",
                "--control",
                control,
                "--name",
                f"e{i}",
                "--size-mb",
                str(args.size_mb),
                "--no-follow",
                "--until",
                str(args.versions - 1),
            )
            procs.append(sub)
            subs.append(sub)
        for sub in subs:
            await event(sub, "ready")
        half = args.versions // 2
        async with WeightSender(publish, config=config) as sender:
            idle = await timed(sender, model, range(half))
            out["server_idle_subscribers_s"] = statistics.median(idle[1:])
            out["server_idle_min_s"] = min(idle)  # steady state: retired segments reused
            # 3. full fan-out: every subscriber follows the newest from now on
            for sub in subs:
                assert sub.stdin is not None
                sub.stdin.write("follow\n")
                sub.stdin.close()
            busy = await timed(sender, model, range(half, args.versions))
            out["server_fanout_s"] = statistics.median(busy)
            out["server_fanout_max_s"] = max(busy)
            out["server_fanout_min_s"] = min(busy)
        newest = args.versions - 1
        expected = tensor_digest(model)
        digests = [await event(sub, "digest") for sub in subs]
        out["bit_exact"] = all(d["digest"] == expected and d["version"] == newest for d in digests)
        # 4. a late joiner
        late = spawn(
            "-m",
            "tests.helpers.server_engine",
            "--control",
            control,
            "--name",
            "late",
            "--size-mb",
            str(args.size_mb),
            "--until",
            str(newest),
        )
        procs.append(late)
        joined = await event(late, "committed")
        out["late_joiner_s"] = joined["seconds"]
        out["late_joiner_exact"] = (await event(late, "digest"))["digest"] == expected
        async with ServerClient(control) as client:
            status = await client.status()
        out["retained"] = status.retained
        # 5. the server's memory
        out["server_memory"] = memory(server.pid)
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in model.values())
        # 6. a relay's pull over loopback tcp beside raw ZMQ tcp of the same bytes
        out.update(await relay_and_raw(model, config, procs))
        out["ratio_idle"] = out["server_idle_subscribers_s"] / out["direct_s"]
        out["ratio_fanout"] = out["server_fanout_s"] / out["direct_s"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
    return out


async def relay_and_raw(
    model: dict[str, torch.Tensor], config: SenderConfig, procs: list[subprocess.Popen[str]]
) -> dict[str, Any]:
    """Seconds for a relay to pull one version over loopback tcp, and for raw ZMQ tcp."""
    import zmq
    import zmq.asyncio

    loopback = ChannelAuth(insecure_loopback=True)
    up = spawn("-m", "aiosync", "serve", "--control", "tcp://127.0.0.1:0", "--insecure-loopback")
    procs.append(up)
    ready = await event(up, "ready")
    out: dict[str, Any] = {}
    store = RetentionStore(RetentionPolicy(max_versions=2))
    relay = Relay(ready["control"], store, lambda version: None, auth=loopback)
    pulls = []
    try:
        async with (
            WeightSender(ready["publish"], config=config) as sender,
            relay.connect() as channel,
        ):
            for version in range(RELAY_VERSIONS):  # every bucket changes every version
                step(model, 1000 + version)
                await sender.send(model, version=version)
                fetched = relay.bytes_fetched
                started = time.perf_counter()
                await relay.pull_once(channel, WAIT)
                pulls.append(time.perf_counter() - started)
                out["relay_bytes"] = relay.bytes_fetched - fetched
    finally:
        store.close()
    out["relay_pulls_s"] = pulls  # the first also hashes upstream and faults memory in
    out["relay_first_s"] = pulls[0]
    out["relay_s"] = statistics.median(pulls[1:])
    total = out["relay_bytes"]
    with zmq.asyncio.Context() as ctx, ctx.socket(zmq.PULL) as sock:
        sock.bind("tcp://127.0.0.1:0")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        raw = spawn("-m", "tests.helpers.server_raw_tcp", endpoint, str(total))
        procs.append(raw)
        received = len(await sock.recv(copy=False))
        started = time.perf_counter()
        while received < total:
            received += len(await sock.recv(copy=False))
        out["raw_tcp_s"] = time.perf_counter() - started  # from the first 4 MiB received
    out["relay_gbps"] = total / out["relay_s"] / 1e9
    out["raw_tcp_gbps"] = total / out["raw_tcp_s"] / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--baseline", type=int, default=5, help="direct versions timed")
    parser.add_argument("--buffer-mb", type=int, default=64)
    args = parser.parse_args()
    result: dict[str, Any] = {}

    async def go() -> None:
        result.update(await bench(args))

    run(go)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
