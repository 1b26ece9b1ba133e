"""CUDA IPC paths; they need a GPU and skip cleanly without one."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
import torch

from aiosync import SenderConfig, WeightSender
from aiosync.channels.zmq import private_ipc_endpoint
from aiosync.compat.nemo_rl import (
    get_handle_from_tensor,
    stream_weights_via_ipc_zmq_impl,
)
from aiosync.planes.cuda_handles import ipc_handle_to_plain
from aiosync.runtime import child_env
from tests.conftest import requires_cuda
from tests.helpers.models import digest, mixed_weights
from tests.processes.test_fleet import digests, engine_processes
from tests.processes.test_processes import next_event, peer

pytestmark = [pytest.mark.gpu, requires_cuda]
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])

CHILD = """
import json, sys, torch
from aiosync.compat.nemo_rl import rebuild_cuda_tensor_from_ipc
from aiosync.planes.cuda_handles import ipc_handle_from_plain
t = rebuild_cuda_tensor_from_ipc(ipc_handle_from_plain(json.loads(sys.argv[1])), 0)
assert torch.equal(t, torch.arange(t.numel(), dtype=t.dtype, device=t.device)), "content"
t[0] = -1.0
torch.cuda.synchronize()
print("ok")
"""


def test_ipc_handle_opens_in_another_process_on_the_same_memory() -> None:
    tensor = torch.arange(4096, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    plain = ipc_handle_to_plain(get_handle_from_tensor(tensor))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(plain)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    torch.cuda.synchronize()
    assert tensor[0].item() == -1.0  # the child wrote into our memory
    assert torch.equal(tensor[1:], torch.arange(1, 4096, dtype=torch.float32, device="cuda:0"))


@only_asyncio
async def test_cuda_weights_stream_through_ipc_buffers_bit_exact() -> None:
    weights = {n: t.cuda() for n, t in mixed_weights(seed=5).items()}
    endpoint, directory = private_ipc_endpoint()
    try:
        with peer("engine", "--endpoint", endpoint, "--module", "--device", "cuda:0") as engine:
            assert (await next_event(engine, 120))["event"] == "ready"
            config = SenderConfig(buffer_bytes=64 * 1024, timeout=60)
            async with WeightSender(endpoint, device="cuda:0", config=config) as sender:
                for version in range(2):
                    for t in weights.values():
                        if t.dtype != torch.bool:
                            t.add_(1)
                    await sender.send(weights.items(), version=version)
                    event = await next_event(engine, 60)
                    assert event["version"] == version
                    assert event["digests"] == {n: digest(t) for n, t in weights.items()}
    finally:
        directory.joinpath("engine.sock").unlink(missing_ok=True)
        directory.rmdir()


@only_asyncio
async def test_compat_streams_cuda_tensors_to_an_engine_process() -> None:
    import zmq

    weights = {n: t.cuda() for n, t in mixed_weights(seed=9).items()}
    endpoint, directory = private_ipc_endpoint()
    try:
        with peer("engine", "--endpoint", endpoint, "--module", "--device", "cuda:0") as engine:
            assert (await next_event(engine, 120))["event"] == "ready"
            ctx = zmq.Context()
            req = ctx.socket(zmq.REQ)
            req.connect(endpoint)
            try:
                await anyio.to_thread.run_sync(
                    stream_weights_via_ipc_zmq_impl, weights.items(), 256 * 1024, req, 0, "policy"
                )
            finally:
                req.close(linger=0)
                ctx.term()
            event = await next_event(engine, 60)
            assert event["digests"] == {n: digest(t) for n, t in weights.items()}
    finally:
        directory.joinpath("engine.sock").unlink(missing_ok=True)
        directory.rmdir()


def test_demo_on_cuda_verifies_every_version() -> None:
    argv = ["demo", "--device", "cuda:0", "--size-mb", "256", "--versions", "3", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "aiosync", *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"]
    assert summary["versions_verified"] == [0, 1, 2]


@only_asyncio
async def test_cuda_fan_out_to_two_engine_processes_bit_exact() -> None:
    """One ring of CUDA buffers, read by two engine processes through CUDA IPC."""
    device = ["--device", "cuda:0"]
    with engine_processes(device, device) as engines:
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=60)
        endpoints = [engine.endpoint for engine in engines]
        async with WeightSender(endpoints, device="cuda:0", config=config) as sender:
            for version in range(2):
                weights = {n: t.cuda() for n, t in mixed_weights(seed=version + 3).items()}
                report = await sender.send(weights, version=version)
                assert sorted(report.committed) == sorted(endpoints)
                for engine in engines:
                    committed = await engine.next_commit()
                    assert committed["version"] == version
                    assert committed["digests"] == digests(weights)
