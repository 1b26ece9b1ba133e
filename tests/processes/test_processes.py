"""Failures across real processes: a peer killed mid-stream, garbage on the socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import torch
import zmq
import zmq.asyncio

from aiosync import (
    AiosyncError,
    ModuleSink,
    PeerGoneError,
    ReceiverConfig,
    SenderConfig,
    SyncTimeoutError,
    WeightReceiver,
    WeightSender,
)
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.zmq import private_ipc_endpoint
from aiosync.compat.nemo_rl import stream_weights_via_ipc_zmq_impl
from aiosync.core.wire import Abort, decode
from aiosync.runtime import child_env
from tests.helpers.models import assert_same, mixed_weights, zeros_like

ROOT = Path(__file__).resolve().parents[2]
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


@contextmanager
def peer(role: str, *argv: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.peers", role, *argv],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


async def next_event(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, object]:
    assert proc.stdout is not None
    with anyio.fail_after(timeout):
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
    assert line, f"peer exited with {proc.poll()}"
    return json.loads(line)


@only_asyncio
async def test_engine_killed_mid_stream_is_noticed_at_once() -> None:
    """The dropped connection ends the stream: no need to wait for the (long) timeout."""
    endpoint, directory = private_ipc_endpoint()
    try:
        with peer("engine", "--endpoint", endpoint, "--delay", "0.5") as engine:
            assert (await next_event(engine))["event"] == "ready"
            config = SenderConfig(buffer_bytes=64 * 1024, timeout=600.0)
            async with WeightSender(endpoint, config=config) as sender:

                async def kill_on_first_bucket() -> None:
                    assert (await next_event(engine))["event"] == "applying"
                    engine.send_signal(signal.SIGKILL)

                with anyio.fail_after(60):  # a hang guard only: the timeout is 600 s
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(kill_on_first_bucket)
                        with pytest.raises(PeerGoneError, match="disconnected") as info:
                            await sender.send(mixed_weights().items(), version=1)
                assert info.value.version == 1
                assert endpoint in str(info.value)
                with pytest.raises(PeerGoneError):
                    await sender.send(mixed_weights().items(), version=2)
    finally:
        directory.joinpath("engine.sock").unlink(missing_ok=True)
        directory.rmdir()


@only_asyncio
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
async def test_trainer_killed_mid_stream_keeps_engine_version(staged: bool) -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    config = ReceiverConfig(stream_timeout=1.0)
    async with WeightReceiver(ModuleSink(target, staged=staged), config=config) as receiver:
        with peer("trainer", "--endpoint", receiver.endpoint, "--stall-after", "1") as trainer:
            assert (await next_event(trainer))["event"] == "synced"
            assert (await next_event(trainer))["event"] == "stalled"
            with anyio.fail_after(10):
                while receiver.streaming is None:  # version 1's first bucket is in
                    await anyio.sleep(0.02)
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=10)  # reaped, as a launcher would: its segments are stale now
            with anyio.fail_after(10):
                while not receiver.failures:
                    await anyio.sleep(0.05)
        failure = receiver.failures[-1]
        assert failure.version == 1
        assert "silent" in failure.reason
        assert receiver.current_version == 0
        assert receiver.servable is staged
        if staged:
            assert_same(target, {k: v.contiguous() for k, v in weights.items()})


async def test_garbage_gets_a_protocol_error_and_the_engine_keeps_serving() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    async with WeightReceiver(ModuleSink(target)) as receiver:
        ctx = zmq.asyncio.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.connect(receiver.endpoint)
        try:
            for junk in (b"\x00\xffnot msgpack", b"\x81\xa4type\xa5bogus", b""):
                await rogue.send(junk)
                with anyio.fail_after(5):
                    reply = decode(await rogue.recv())
                assert isinstance(reply, Abort)
                assert "undecodable" in reply.reason or "before hello" in reply.reason
        finally:
            rogue.close(linger=0)
            ctx.term()
        assert receiver.protocol_errors == 3
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
        async with WeightSender(receiver.endpoint, config=config) as sender:
            await sender.send(weights.items(), version=0)
        assert receiver.current_version == 0
        assert_same(target, {k: v.contiguous() for k, v in weights.items()})


async def test_raw_tcp_garbage_does_not_stop_the_engine() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    insecure = ChannelAuth(insecure_loopback=True)
    async with WeightReceiver(ModuleSink(target), "tcp://127.0.0.1:*", auth=insecure) as receiver:
        host, port = receiver.endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1"
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(os.urandom(4096))
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
        async with WeightSender(receiver.endpoint, config=config, auth=insecure) as sender:
            await sender.send(weights.items(), version=0)
        assert receiver.current_version == 0


async def test_compat_stream_over_a_callers_req_socket() -> None:
    trainer = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 300))
    engine = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 300))
    async with WeightReceiver(ModuleSink(engine)) as receiver:
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ)
        req.connect(receiver.endpoint)
        try:
            for expected in (0, 1):
                with torch.no_grad():
                    trainer[0].weight.add_(1)
                await anyio.to_thread.run_sync(
                    stream_weights_via_ipc_zmq_impl,
                    trainer.named_parameters(),
                    32 * 1024,
                    req,
                    0,
                    "policy",
                )
                assert receiver.current_version == expected
                assert_same(trainer.state_dict(), engine.state_dict())
            bad = [("0.weight", torch.ones(2, 2))]
            with pytest.raises(AiosyncError, match=r"0\.weight"):
                await anyio.to_thread.run_sync(
                    stream_weights_via_ipc_zmq_impl, bad, 32 * 1024, req, 0, "policy"
                )
        finally:
            req.close(linger=0)
            ctx.term()
        assert receiver.current_version == 1


@only_asyncio
async def test_engine_killed_under_a_callers_socket_raises_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller's REQ socket has no connection monitor: the ack timeout bounds the wait."""
    monkeypatch.setenv("AIOSYNC_TIMEOUT", "2")
    endpoint, directory = private_ipc_endpoint()
    try:
        with peer("engine", "--endpoint", endpoint, "--delay", "0.5") as engine:
            assert (await next_event(engine))["event"] == "ready"
            ctx = zmq.Context()
            req = ctx.socket(zmq.REQ)
            req.connect(endpoint)
            try:

                async def kill_on_first_bucket() -> None:
                    assert (await next_event(engine))["event"] == "applying"
                    engine.send_signal(signal.SIGKILL)

                with anyio.fail_after(60):  # a hang guard only
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(kill_on_first_bucket)
                        with pytest.raises(SyncTimeoutError, match="no ack"):
                            await anyio.to_thread.run_sync(
                                stream_weights_via_ipc_zmq_impl,
                                mixed_weights().items(),
                                128 * 1024,
                                req,
                                0,
                                "policy",
                            )
            finally:
                req.close(linger=0)
                ctx.term()
    finally:
        directory.joinpath("engine.sock").unlink(missing_ok=True)
        directory.rmdir()
