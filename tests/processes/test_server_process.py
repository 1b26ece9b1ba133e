"""``aiosync serve`` as a process: a SIGTERM during a transfer, then nothing left behind;
and the metrics and health endpoint (loopback only, off by default)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.core.errors import PeerGoneError, UsageError
from aiosync.private_dirs import creator_pid
from aiosync.server import ServerConfig, Subscriber, WeightServer
from tests.api.test_server import empty, model, same

WAIT = 30.0
ROOT = Path(__file__).resolve().parents[2]


def private_dirs_of(pid: int) -> list[Path]:
    import tempfile

    return [p for p in Path(tempfile.gettempdir()).glob("aiosync-*") if creator_pid(p) == pid]


def segments_of(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"aiosync-*-{pid}-*")]


async def read_line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    with anyio.fail_after(WAIT):
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
    assert line, f"server exited with {proc.poll()}"
    return json.loads(line)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_a_transfer_leaves_shm_and_private_dirs_clean(
    signum: int, status: int
) -> None:
    anyio.run(signal_during_a_transfer, signum, status)  # once per signal, on asyncio


async def signal_during_a_transfer(signum: int, status: int) -> None:
    env = {**os.environ, "AIOSYNC_SHM_BACKEND": "file"}  # named segments: /dev/shm can show them
    server = subprocess.Popen(
        [sys.executable, "-m", "aiosync", "serve", "--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    entered, release = threading.Event(), threading.Event()

    class StuckSink(ModuleSink):
        def apply_bucket(self, bucket: torch.Tensor, specs: list) -> None:  # type: ignore[override]
            entered.set()
            release.wait(WAIT)
            super().apply_bucket(bucket, specs)

    try:
        ready = await read_line(server)
        publish, control = str(ready["publish"]), str(ready["control"])
        dirs = {Path(e.removeprefix("ipc://")).parent for e in (publish, control)}
        assert all(d.is_dir() for d in dirs)
        held = empty()
        config = SenderConfig(buffer_bytes=64 << 10, timeout=WAIT)
        async with (
            Subscriber(control, StuckSink(held, staged=True), name="stuck") as sub,
            WeightSender(publish, config=config) as sender,
        ):
            await sender.send(model(0), version=0)  # returns once the server holds it
            assert segments_of(server.pid)  # retained in /dev/shm
            await anyio.to_thread.run_sync(entered.wait, WAIT)  # a transfer is in flight
            server.send_signal(signum)
            _, err = await anyio.to_thread.run_sync(lambda: server.communicate(timeout=60))
            release.set()
            assert server.returncode == status, err
            assert "Traceback" not in err
            assert not segments_of(server.pid)
            assert not any(d.exists() for d in dirs)
            assert not private_dirs_of(server.pid)
            with pytest.raises(PeerGoneError):
                await sub.client.status()
            with anyio.fail_after(WAIT):  # the transfer was aborted, and the engine told
                while not sub.receiver.failures:
                    await anyio.sleep(0.01)
            assert "abandoned" in str(sub.receiver.failures[0])
            assert sub.current_version is None  # nothing half-applied became live
            assert same(held, empty())
    finally:
        release.set()
        if server.poll() is None:
            server.kill()
        server.communicate(timeout=10)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def test_metrics_and_health_on_loopback() -> None:
    with pytest.raises(UsageError, match="loopback"):
        async with WeightServer(ServerConfig(metrics_port=0, metrics_host="0.0.0.0")):
            pass
    async with WeightServer() as off:
        assert off.metrics_address is None  # off by default
    async with WeightServer(ServerConfig(metrics_port=0, timeout=WAIT)) as server:
        address = server.metrics_address
        assert address is not None
        assert address.startswith("http://127.0.0.1:")
        code, body = await anyio.to_thread.run_sync(get, address + "/healthz")
        assert code == 503
        assert json.loads(body)["ready"] is False
        held = empty()
        async with (
            WeightSender(server.publish_endpoint, config=SenderConfig(timeout=WAIT)) as sender,
            Subscriber(server.control_endpoint, ModuleSink(held), name="e0"),
        ):
            await sender.send(model(1), version=1)
            await server.wait_for(1, WAIT)
            code, body = await anyio.to_thread.run_sync(get, address + "/healthz")
            assert code == 200
            assert json.loads(body)["engines"] == {"e0": {"version": 1, "lag": 0}}
            code, text = await anyio.to_thread.run_sync(get, address + "/metrics")
        assert code == 200
        metrics = text.decode()
        nbytes = sum(t.numel() * t.element_size() for t in model(1).values())
        assert "aiosync_versions_published_total 1.0" in metrics
        assert "aiosync_versions_served_total 1.0" in metrics
        values = dict(
            line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#")
        )
        published = float(values["aiosync_bytes_published_total"])
        assert float(values["aiosync_bytes_served_total"]) == published >= nbytes  # + padding
        assert 'aiosync_engine_version{engine="e0"} 1.0' in metrics
        assert 'aiosync_stage_seconds_count{stage="transfer"} 1.0' in metrics
        assert 'aiosync_stage_seconds_count{stage="publish"} 1.0' in metrics
