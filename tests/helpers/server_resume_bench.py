"""What engine resume costs and saves, in one process (docs/server.md, "Engine resume").

Run as ``python -m tests.helpers.server_resume_bench [--size-mb 256] [--repeats 3]``. One server
takes each version a publisher sends; a subscriber takes them (no resume, resume in
memory, resume in a directory: median seconds from the server holding a version to the
engine committing it), then one whose first transfer breaks halfway resumes. Prints one
JSON line, with the bytes sent on the resumed transfer and the server's one-off digest
time for a version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import anyio

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.bench.model import synthetic_state_dict
from aiosync.runtime import run
from aiosync.server import ServerConfig, Subscriber, WeightServer
from tests.api.test_server_resume import buckets_of, dropping_once, subscribed, until

WAIT = 600.0


async def bench(size_mb: int, repeats: int) -> dict[str, Any]:
    weights = synthetic_state_dict(size_mb << 20)
    config = SenderConfig(buffer_bytes=32 << 20, num_buffers=2, timeout=WAIT)
    out: dict[str, Any] = {"size_mb": size_mb, "repeats": repeats}
    async with (
        WeightServer(ServerConfig(timeout=WAIT)) as server,
        WeightSender(server.publish_endpoint, config=config) as sender,
    ):
        await sender.send(weights, version=0)
        retained = server.store.pin(0)
        assert retained is not None
        began = time.perf_counter()
        await anyio.to_thread.run_sync(retained.digests)
        out["digest_s"] = time.perf_counter() - began
        server.store.unpin(0)
        out["buckets"] = len(buckets_of(server, 0))

        version = 0

        async def steady(name: str, **resume: Any) -> list[float]:
            """Seconds from each version held by the server to committed by the engine."""
            nonlocal version
            target = {k: v.clone() for k, v in weights.items()}
            times = []
            async with Subscriber(
                server.control_endpoint, ModuleSink(target), name=name, **resume
            ) as sub:
                await sub.wait_for_version(version, WAIT)
                for _ in range(repeats):
                    version += 1
                    await sender.send(weights, version=version)
                    began = time.perf_counter()
                    await sub.wait_for_version(version, WAIT)
                    times.append(time.perf_counter() - began)
            return times

        for case, resume in [
            ("plain", {}),
            ("resume_memory", {"resume": True}),
            ("resume_dir", {"resume_dir": tempfile.mkdtemp()}),
        ]:
            out[f"{case}_s"] = statistics.median(await steady(case, **resume))
        version += 1
        await sender.send(weights, version=version)

        half = out["buckets"] // 2
        target = {k: v.clone() for k, v in weights.items()}
        async with dropping_once(after=half):
            sub = Subscriber(server.control_endpoint, ModuleSink(target), name="r", resume=True)
            async with sub:
                await until(lambda: "r" not in server.fleet.subscribers)
                held = sub.held
                assert held is not None
                await until(lambda: len(held.digests()) == half)
                began = time.perf_counter()
                await sub.resubscribe(WAIT)
                state = await subscribed(server, "r")
                await sub.wait_for_version(version, WAIT)
                out["resumed_s"] = time.perf_counter() - began
        out["resumed_bytes_sent"] = state.bytes_sent
        out["resumed_bytes_held"] = state.bytes_held
        out["version_bytes"] = sum(used for _, used in buckets_of(server, version))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    async def go() -> None:
        print(json.dumps(await bench(args.size_mb, args.repeats)), flush=True)

    run(go)


if __name__ == "__main__":
    main()
