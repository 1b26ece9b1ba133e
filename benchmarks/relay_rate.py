"""A relay's pull beside raw ZMQ tcp of the same bytes, with the same CURVE setting, in one run.

    python -m benchmarks.relay_rate --size-mb 256 --repeats 5 --curve off,on

For each CURVE setting it starts an upstream server (``aiosync serve`` on loopback tcp:
CURVE keys made for the run, or ``--insecure-loopback``), publishes a synthetic model into it
(every bucket changed each version) and, ``--repeats`` times after three warm-up rounds
(until both stores reuse memory, as they do in a steady stream of versions): pulls
the new version into a :class:`~aiosync.server.relay.Relay` in this process (timed from the
pull to the version retained), then moves the same number of bytes over raw ZMQ tcp
(PUSH in another process, PULL here, 4 MiB messages not copied out, the same CURVE
setting), timed from the go to the last byte. Prints one JSON object: every figure, the
medians, and the relay's throughput over raw (``relay_over_raw``; the issue asks >= 0.8);
besides wall time, the CPU seconds both processes of each transfer spent (``*_cpu_s``),
which a shared machine moves less; and for the relay, the seconds to its head (the
upstream hashing the version) and of its fetch (``head_s``, ``fetch_s``).

``--tree DIR`` takes the package (this process's and the children's) from another checkout,
to run the code before a change beside it. With ``link`` (``python -m benchmarks.link_proxy
bench``) both go through a
:class:`~benchmarks.link_proxy.LinkProxy` process each, and the figures are also put against
bytes / link rate (``relay_over_link``: the issue asks <= 1.15 at 10 Gb/s and 0.2 ms).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import torch

ROOT = Path(__file__).resolve().parent.parent
WAIT = 600.0
RAW_CHUNK = 4 << 20
WARM = 3
"""Rounds not timed: until both stores reuse the segments of evicted versions (retaining
two, the third version is the first whose segments are not faulted in fresh)."""
Link = tuple[float, float, int]  # Gbit/s, one-way ms, burst KiB


def spawn(*argv: str) -> subprocess.Popen[str]:
    """A child Python process of this tree (the package from ``AIOSYNC_TREE``, if set)."""
    shim = os.environ.get("AIOSYNC_TREE", "")
    trees = [shim, str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(tree for tree in trees if tree))
    return subprocess.Popen(
        [sys.executable, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=shim or ROOT,  # ``-m`` puts the working directory first on the path
    )


async def ready(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's first JSON line with ``"event": "ready"``."""
    assert proc.stdout is not None
    with anyio.fail_after(WAIT):
        while True:
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
            if not line:
                raise RuntimeError(f"{proc.args!r} exited with {proc.poll()}")
            found: dict[str, Any] = json.loads(line)
            if found.get("event") == "ready":
                return found


@asynccontextmanager
async def child(*argv: str) -> AsyncIterator[dict[str, Any]]:
    """A child process and its ready line, ended when the block ends."""
    proc = spawn(*argv)
    try:
        yield {**await ready(proc), "proc": proc}
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@asynccontextmanager
async def reach(link: Link | None, target: str) -> AsyncIterator[str]:
    """``target`` itself, or the endpoint of a link proxy in front of it."""
    if link is None:
        yield target
        return
    gbit, ms, burst = link
    argv = ["-m", "benchmarks.link_proxy", "serve", "--target", target]
    argv += ["--rate-gbit", str(gbit), "--latency-ms", str(ms), "--burst-kib", str(burst)]
    async with child(*argv) as proxy:
        yield str(proxy["listen"])


def step(model: dict[str, torch.Tensor], version: int) -> None:
    """Change every bucket: one element of every tensor says the version."""
    for tensor in model.values():
        tensor.view(-1)[0] = float(version)


async def curve_case(args: argparse.Namespace, curve: bool, link: Link | None) -> dict[str, Any]:
    """One CURVE setting: warm-up, then ``repeats`` rounds of a relay pull and a raw transfer."""
    import zmq

    from aiosync import SenderConfig, WeightSender
    from aiosync.bench.model import synthetic_state_dict
    from aiosync.channels.keys import ChannelAuth, generate_keypair
    from aiosync.server import RetentionPolicy
    from aiosync.server.relay import Relay
    from aiosync.server.store import RetentionStore

    model = synthetic_state_dict(args.size_mb << 20)
    config = SenderConfig(buffer_bytes=64 << 20, num_buffers=2, timeout=WAIT)
    figures = ("relay_s", "raw_s", "head_s", "fetch_s", "relay_cpu_s", "raw_cpu_s")
    out: dict[str, Any] = {name: [] for name in figures}
    with tempfile.TemporaryDirectory() as keys:
        serve = ["-m", "aiosync", "serve", "--control", "tcp://127.0.0.1:0", "--timeout", "600"]
        if curve:
            up_pub, up_sec = generate_keypair(Path(keys) / "up", "up")
            relay_pub, relay_sec = generate_keypair(Path(keys) / "relay", "relay")
            serve += ["--keypair", str(up_sec), "--allow", str(relay_pub)]
            auth = ChannelAuth.client(relay_sec, up_pub)
        else:
            serve.append("--insecure-loopback")
            auth = ChannelAuth(insecure_loopback=True)
        async with AsyncExitStack() as stack:
            up = await stack.enter_async_context(child(*serve))
            control = await stack.enter_async_context(reach(link, up["control"]))
            raw_argv = ["-m", "benchmarks.relay_rate", "raw-send"]
            if curve:
                raw_argv.append("--curve")
            raw = await stack.enter_async_context(child(*raw_argv))
            raw_at = await stack.enter_async_context(reach(link, raw["endpoint"]))
            store = RetentionStore(RetentionPolicy(max_versions=2))
            stack.callback(store.close)
            relay = Relay(control, store, lambda version: None, auth=auth)
            sender = await stack.enter_async_context(
                WeightSender(up["publish"], config=config, auth=auth if curve else None)
            )
            channel = await stack.enter_async_context(relay.connect())
            ctx = zmq.Context()
            stack.callback(ctx.term)
            pull = ctx.socket(zmq.PULL)
            stack.callback(pull.close, 0)
            if curve:
                pull.curve_serverkey = raw["public"].encode()
                pull.curve_publickey, pull.curve_secretkey = zmq.curve_keypair()
            pull.connect(raw_at)
            for version in range(WARM + args.repeats):
                step(model, 1000 + version)
                await sender.send(model, version=version)
                fetched = relay.bytes_fetched
                started, cpu = time.perf_counter(), cpu_seconds(up["proc"].pid)
                await relay.pull_once(channel, WAIT)
                relay_s = time.perf_counter() - started
                relay_cpu = cpu_seconds(up["proc"].pid) - cpu
                cpu = cpu_seconds(raw["proc"].pid)
                out["bytes"] = relay.bytes_fetched - fetched
                raw_s = await anyio.to_thread.run_sync(raw_round, raw["proc"], pull, out["bytes"])
                raw_cpu = cpu_seconds(raw["proc"].pid) - cpu
                if version >= WARM:
                    out["relay_s"].append(relay_s)
                    out["raw_s"].append(raw_s)
                    out["relay_cpu_s"].append(relay_cpu)
                    out["raw_cpu_s"].append(raw_cpu)
                    times = getattr(relay, "last_pull", None)  # None: a tree before issue 29
                    if times is not None:
                        out["head_s"].append(times.head)  # the upstream hashes the version
                        out["fetch_s"].append(times.fetched - times.head)
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, every thread) of this process and of process ``pid``.

    On a shared machine these move less than wall time: what each transfer costs.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    child = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return child + own.user + own.system


def raw_round(proc: subprocess.Popen[str], pull: Any, nbytes: int) -> float:
    """Seconds for the raw sender to move ``nbytes`` to ``pull``, from its go."""
    assert proc.stdin is not None
    started = time.perf_counter()
    proc.stdin.write(f"{nbytes}\n")
    proc.stdin.flush()
    received = 0
    while received < nbytes:
        received += len(pull.recv(copy=False))
    return time.perf_counter() - started


def raw_send(curve: bool) -> None:
    """The raw sender: bind a PUSH, then send the bytes asked for on each line of stdin.

    ``curve``: as a CURVE server with a keypair of its own (its public key is printed).
    """
    import zmq

    data = bytes(RAW_CHUNK)
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
        public = ""
        if curve:
            public_key, secret_key = zmq.curve_keypair()
            sock.curve_server = True
            sock.curve_secretkey, sock.curve_publickey = secret_key, public_key
            public = public_key.decode()
        sock.bind("tcp://127.0.0.1:0")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        print(json.dumps({"event": "ready", "endpoint": endpoint, "public": public}), flush=True)
        for line in sys.stdin:
            total, sent = int(line), 0
            while sent < total:
                n = min(RAW_CHUNK, total - sent)
                sock.send(memoryview(data)[:n], copy=False)
                sent += n


def summary(case: dict[str, Any], link: Link | None) -> dict[str, Any]:
    """Medians, throughputs and ratios of one CURVE setting."""
    relay, raw = statistics.median(case["relay_s"]), statistics.median(case["raw_s"])
    nbytes = case["bytes"]
    out = {
        **case,
        "relay_median_s": relay,
        "raw_median_s": raw,
        "relay_gbps": nbytes / relay / 1e9,
        "raw_gbps": nbytes / raw / 1e9,
        "relay_over_raw": raw / relay,  # throughput ratio
        "relay_cpu_median_s": statistics.median(case["relay_cpu_s"]),
        "raw_cpu_median_s": statistics.median(case["raw_cpu_s"]),
    }
    if link is not None:
        floor = nbytes / (link[0] * 1e9 / 8)
        out.update(link_s=floor, relay_over_link=relay / floor, raw_over_link=raw / floor)
    return out


def run_bench(args: argparse.Namespace, link: Link | None = None) -> dict[str, Any]:
    """Every CURVE setting asked for, one after the other, in this process."""
    from aiosync.runtime import run

    result: dict[str, Any] = {"size_mb": args.size_mb, "repeats": args.repeats, "link": link}

    async def go() -> None:
        for setting in args.curve.split(","):
            case = await curve_case(args, setting.strip() == "on", link)
            result[f"curve_{setting.strip()}"] = summary(case, link)

    run(go)
    return result


def use_tree(tree: str) -> None:
    """Take the package from checkout ``tree`` here and in every child from now on.

    A directory holding only a link to that tree's package goes first on every path (the
    children's working directory too: ``-m`` puts it first), so ``benchmarks`` is still
    this one's.
    """
    shim = Path(tempfile.mkdtemp(prefix="aiosync-tree-"))
    atexit.register(shutil.rmtree, shim, True)
    (shim / "aiosync").symlink_to(Path(tree).resolve() / "aiosync")
    os.environ["AIOSYNC_TREE"] = str(shim)
    sys.path.insert(0, str(shim))


def main() -> None:
    """Parse the flags; run the benchmark (or, as a child, the raw sender)."""
    if sys.argv[1:2] == ["raw-send"]:
        raw_send("--curve" in sys.argv)
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_rate")
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--curve", default="off,on", help="off, on, or off,on")
    parser.add_argument(
        "--tree", help="take the package from this checkout (a revision before a change)"
    )
    args = parser.parse_args()
    if args.tree:
        use_tree(args.tree)
    print(json.dumps(run_bench(args)))


if __name__ == "__main__":
    main()
