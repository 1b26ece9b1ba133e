"""Handles and channels are safe to drop, usable from any event loop, and every call ends.

Issue 25, item 2: a ``ChannelHandle.connect`` handle dropped without ``aclose()`` made the
next ``gc.collect()`` hang in ZMQ's context termination, and a handle awaited from the
user's own loop after NeMo-RL's blocking functions drove it on theirs could hang with no
timeout. The drop tests run in a child process with a time limit: a hang fails them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from typing import Any

import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from aiosync.channels.zmq import RouterPeer, ZmqChannel, ZmqListener
from aiosync.compat import distributed
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.compat.nemo_rl import iter_named_tensor_buckets
from aiosync.core.errors import SyncTimeoutError, UsageError
from aiosync.handles import ChannelHandle, ObjectHandle, RayActorHandle, serve_engine
from aiosync.runtime import child_env
from tests.helpers.handle_peers import ROOT, engine_process
from tests.helpers.models import mixed_weights

GUARD = 60  # seconds: a hang guard only, never a measured bound

DROP_SCRIPT = """
import asyncio, gc, os, queue, threading
import anyio
from aiosync.channels.zmq import ZmqChannel, ZmqListener
from aiosync.compat import distributed
from aiosync.handles import ChannelHandle, ObjectHandle, serve_engine

class Engine:
    def check_health(self):
        return {"healthy": True, "weight_version": 3}

async def main():
    listener = ZmqListener.open()
    tg = anyio.create_task_group()
    await tg.__aenter__()
    tg.start_soon(serve_engine, listener, ObjectHandle(Engine()))
    handle = ChannelHandle.connect(listener.endpoint, name="engine-0", timeout=30)
    assert (await handle.check_health()).weight_version == "3"
    channel = ZmqChannel.connect(listener.endpoint)
    await channel.send(b"not a request")
    tg.cancel_scope.cancel()
    await tg.__aexit__(None, None, None)
    return listener.endpoint  # the listener, handle and channel are dropped unclosed

endpoint = asyncio.run(main())
gc.collect()
print("collected", os.path.exists(endpoint.removeprefix("ipc://")), flush=True)

endpoints = queue.Queue()

async def serve_forever():
    listener = ZmqListener.open()
    endpoints.put(listener.endpoint)
    await serve_engine(listener, ObjectHandle(Engine()))

threading.Thread(target=asyncio.run, args=(serve_forever(),), daemon=True).start()
handle = ChannelHandle.connect(endpoints.get(timeout=30), name="engine-1", timeout=30)
assert distributed._loop().call(handle.check_health).healthy  # on the compat loop
assert asyncio.run(handle.check_health()).healthy  # then on the user's own loop
del handle  # dropped while the compat loop that drove it still runs
gc.collect()
print("dropped", flush=True)
"""


def test_a_handle_channel_and_listener_dropped_without_aclose_never_hang_gc() -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", DROP_SCRIPT],
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=ROOT,
            timeout=GUARD,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hung; it printed {exc.stdout!r}") from None
    assert done.returncode == 0, done.stderr
    # the dropped listener removed its socket file
    assert done.stdout.split("\n")[:2] == ["collected False", "dropped"]


class StuckEngine:
    """Answers health checks until ``stuck`` is set; then every call waits forever."""

    def __init__(self) -> None:
        self.stuck = False

    async def check_health(self) -> dict[str, Any]:
        if self.stuck:
            await anyio.sleep_forever()
        return {"healthy": True, "weight_version": 1}

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await anyio.sleep_forever()


async def test_a_call_on_an_engine_gone_silent_ends_in_sync_timeout_error_naming_it() -> None:
    engine = StuckEngine()
    listener = ZmqListener.open()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_engine, listener, ObjectHandle(engine))
            async with ChannelHandle.connect(listener.endpoint, name="engine-7", timeout=0.5) as h:
                with anyio.fail_after(GUARD):
                    assert (await h.check_health()).healthy
                    engine.stuck = True
                    with pytest.raises(SyncTimeoutError) as info:
                        await h.destroy_weights_update_group("g")
                    health = await h.check_health()  # never raises: unhealthy, saying why
            tg.cancel_scope.cancel()
    finally:
        await listener.aclose()
    assert info.value.peer == "engine-7"
    assert isinstance(info.value, TimeoutError)
    assert "destroy_weights_update_group() within 0.5s" in str(info.value)
    assert not health.healthy
    assert "no answer to check_health() within 0.5s" in health.message


class SilentRef:
    """An ObjectRef stand-in that is never ready."""

    def __await__(self) -> Any:
        return asyncio.get_running_loop().create_future().__await__()


class SilentActor:
    """A Ray actor stand-in whose every method's task never finishes."""

    def __getattr__(self, method: str) -> Any:
        return type("Method", (), {"remote": staticmethod(lambda **_: SilentRef())})()


async def test_a_ray_actor_that_never_answers_ends_in_sync_timeout_error_naming_it() -> None:
    pytest.importorskip("ray")
    handle = RayActorHandle(SilentActor(), name="actor-3", timeout=0.2)
    with anyio.fail_after(GUARD), pytest.raises(SyncTimeoutError) as info:
        await handle.destroy_weights_update_group("g")
    assert info.value.peer == "actor-3"
    with anyio.fail_after(GUARD):
        health = await handle.check_health()
    assert not health.healthy
    assert "check_health() within 0.2s" in health.message
    import ray

    assert not ray.is_initialized()  # a timeout never starts a local Ray instance


def test_a_handle_timeout_must_be_positive() -> None:
    channel = ZmqChannel.connect("ipc:///nonexistent/aiosync-lifecycle.sock")
    try:
        for bad in (0, -1.0, float("nan")):
            with pytest.raises(UsageError, match="timeout must be positive"):
                ChannelHandle(channel, timeout=bad)
            with pytest.raises(UsageError, match="timeout must be positive"):
                RayActorHandle(object(), timeout=bad)
    finally:
        asyncio.run(channel.aclose())


def _trial_send(handles: list[ChannelHandle], group: object, version: int) -> None:
    broadcast_hf_buckets_via_distributed_impl(
        bucket_iterator=iter_named_tensor_buckets(mixed_weights(version).items(), 128 << 10),
        rollout_engines=handles,
        rollout_engine_lock=threading.Lock(),
        group_name="trial",
        model_update_group=group,  # type: ignore[arg-type]
        weight_version=version,
    )


def test_the_trial_nemo_rl_functions_drive_a_handle_then_the_users_own_loop_awaits_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "30")
    with engine_process("--name", "engine-0", "--timeout", "30") as engine:
        handle = ChannelHandle.connect(engine.endpoint, name="engine-0", timeout=30)
        group = connect_rollout_engines_from_distributed(
            group_name="trial", rollout_engines=[handle], engine_gpu_counts=[1]
        )
        _trial_send([handle], group, 1)
        engine.wait_for("committed", version=1)

        async def users_own() -> str | None:
            health = await handle.check_health()  # the same handle, from asyncio.run's loop
            return health.weight_version

        assert asyncio.run(users_own()) == "1"
        assert asyncio.run(users_own()) == "1"  # a second loop of the user's, the first closed
        _trial_send([handle], group, 2)  # the compat loop's own channel still works
        engine.wait_for("committed", version=2)
        disconnect_rollout_engines_from_distributed(
            group_name="trial", model_update_group=group, rollout_engines=[handle]
        )
        asyncio.run(handle.aclose())  # from the user's loop: the compat loop's channel too
        with pytest.raises(UsageError, match="handle is closed") as info:
            distributed._loop().call(handle.destroy_weights_update_group, "trial")
        assert info.value.peer == "engine-0"


def test_a_handle_on_a_given_channel_moves_between_loops_but_refuses_two_running() -> None:
    listener_ready = threading.Event()
    endpoint: list[str] = []

    async def serve() -> None:
        listener = ZmqListener.open()
        endpoint.append(listener.endpoint)
        listener_ready.set()
        try:
            await serve_engine(listener, ObjectHandle(StuckEngine()))
        finally:
            await listener.aclose()

    with start_blocking_portal("asyncio") as engine_loop, start_blocking_portal() as other:
        serving = engine_loop.start_task_soon(serve)
        assert listener_ready.wait(GUARD)
        handle = ChannelHandle(ZmqChannel.connect(endpoint[0]), name="given", timeout=30)
        assert other.call(handle.check_health).healthy  # bound to the other running loop
        refused = asyncio.run(handle.check_health())
        assert not refused.healthy
        assert "in use on another event loop" in refused.message
        with pytest.raises(UsageError, match=r"ChannelHandle\.connect opens one for each loop"):
            asyncio.run(handle.destroy_weights_update_group("g"))
        other.call(handle.aclose)
        serving.cancel()


def test_a_channel_moves_to_a_new_loop_once_its_loop_stopped_never_while_it_runs() -> None:
    async def echo(listener: ZmqListener) -> None:
        async def answer(peer: RouterPeer) -> None:
            while True:
                await peer.send(await peer.recv())

        async with anyio.create_task_group() as tg:
            while True:  # accepting is what delivers every peer's messages
                tg.start_soon(answer, await listener.accept())

    async def roundtrip(channel: ZmqChannel, payload: bytes) -> bytes:
        with anyio.fail_after(GUARD):
            await channel.send(payload)
            return await channel.recv()

    with start_blocking_portal("asyncio") as server:
        listener = server.call(ZmqListener.open)
        serving = server.start_task_soon(echo, listener)
        channel = ZmqChannel.connect(listener.endpoint)
        with start_blocking_portal("asyncio") as first:
            assert first.call(roundtrip, channel, b"one") == b"one"
            with pytest.raises(UsageError, match="another event loop") as info:
                asyncio.run(roundtrip(channel, b"two"))
            assert info.value.peer == listener.endpoint
        assert asyncio.run(roundtrip(channel, b"three")) == b"three"  # the first loop ended
        asyncio.run(channel.aclose())
        serving.cancel()
        server.call(listener.aclose)
