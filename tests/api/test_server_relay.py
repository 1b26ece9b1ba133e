"""Relays (issue 12, items 4 and 5): a server fed by another over loopback tcp with CURVE
keys, engines on both; buckets identified by content, so an interrupted pull resumes with
only the missing buckets and an unchanged bucket never crosses the network again."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.channels.keys import ChannelAuth, generate_keypair, load_public_key
from aiosync.core.errors import AiosyncError
from aiosync.server import RetentionPolicy, ServerConfig, Subscriber, WeightServer
from aiosync.server.relay import Relay
from aiosync.server.store import RetentionStore
from tests.api.test_server import empty, model, same

WAIT = 30.0
SMALL = SenderConfig(buffer_bytes=64 << 10, num_buffers=2, timeout=WAIT)


def keys(tmp_path: Path) -> tuple[ChannelAuth, ChannelAuth]:
    """The upstream's server keys, and the relay's client keys for it."""
    up_pub, up_sec = generate_keypair(tmp_path / "up", "up")
    relay_pub, relay_sec = generate_keypair(tmp_path / "relay", "relay")
    server = ChannelAuth.server(up_sec, [load_public_key(relay_pub)])
    return server, ChannelAuth.client(relay_sec, up_pub)


async def test_two_servers_on_loopback_tcp_each_feeding_its_engines(tmp_path: Path) -> None:
    server_auth, relay_auth = keys(tmp_path)
    upstream_config = ServerConfig(
        control_endpoint="tcp://127.0.0.1:0", auth=server_auth, timeout=WAIT
    )
    async with WeightServer(upstream_config) as upstream:
        relay_config = ServerConfig(
            upstream=upstream.control_endpoint, upstream_auth=relay_auth, timeout=WAIT
        )
        there = empty()
        async with (
            WeightServer(relay_config) as relay,
            WeightSender(upstream.publish_endpoint, config=SMALL, auth=relay_auth) as sender,
            Subscriber(relay.control_endpoint, ModuleSink(there), name="far") as far,
        ):
            sent = 0
            for version in range(3):
                await sender.send(model(version), version=version)
                await relay.wait_for(version, WAIT)  # the relay's engine has it
                assert far.current_version == version
                assert same(there, model(version))
                sent += upstream.store.book.bytes_of(version)
            # every version crossed the network once, whole (no bucket repeats here)
            assert upstream.relays.bytes_sent == sent
            assert relay.relay is not None
            assert relay.relay.bytes_fetched == sent


async def test_interrupted_pull_resumes_with_only_the_missing_buckets(tmp_path: Path) -> None:
    server_auth, relay_auth = keys(tmp_path)
    config = ServerConfig(control_endpoint="tcp://127.0.0.1:0", auth=server_auth, timeout=WAIT)
    async with (
        WeightServer(config) as upstream,
        WeightSender(upstream.publish_endpoint, config=SMALL, auth=relay_auth) as sender,
    ):
        weights = model(0)
        await sender.send(weights, version=0)
        retained = upstream.store.pin(0)
        assert retained is not None
        sizes = [bucket.used for bucket in retained.buckets]
        upstream.store.unpin(0)
        assert len(sizes) >= 4
        store = RetentionStore(RetentionPolicy(max_versions=2))
        published: list[int] = []
        relay = Relay(upstream.control_endpoint, store, published.append, auth=relay_auth)
        try:
            async with relay.connect() as channel:  # the connection breaks after 2 buckets
                with pytest.raises(AiosyncError, match="stopped"):
                    await relay.pull_once(channel, WAIT, stop_after=2)
            first = upstream.relays.bytes_sent
            assert first == sum(sizes[:2])
            assert store.newest is None  # nothing half-pulled was retained
            async with relay.connect() as channel:  # a new connection: only the rest comes
                assert await relay.pull_once(channel, WAIT) == 0
                assert upstream.relays.bytes_sent - first == sum(sizes[2:])
                assert relay.bytes_reused == sum(sizes[:2])  # kept in their segments
                # a version where one tensor changed: only its bucket crosses again
                weights["layer.0.bias"] += 1
                await sender.send(weights, version=1)
                before = upstream.relays.bytes_sent
                assert await relay.pull_once(channel, WAIT) == 1
                again = upstream.relays.bytes_sent - before
                assert 0 < again < sum(sizes) // 2
            assert published == [0, 1]
            held = store.pin(1)
            assert held is not None
            assert held.nbytes == upstream.store.book.bytes_of(1)
            store.unpin(1)
        finally:
            store.close()
        assert not upstream.store.book.pinned(0)  # a relay holds no pin between buckets
        assert not upstream.store.book.pinned(1)


def test_a_relay_process_killed_mid_pull_fetches_only_the_rest_after_restart(
    tmp_path: Path,
) -> None:
    """``aiosync serve --upstream ... --resume-dir D`` is killed (SIGKILL) while pulling a
    version, then started again: it reads back what it had saved and fetches only the rest."""
    import anyio

    anyio.run(killed_relay_resumes, tmp_path)  # once, on asyncio: the processes are slow


async def killed_relay_resumes(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    import anyio

    from aiosync.runtime import child_env

    loopback = ChannelAuth(insecure_loopback=True)
    config = ServerConfig(control_endpoint="tcp://127.0.0.1:0", auth=loopback, timeout=WAIT)
    resume = tmp_path / "resume"
    async with (
        WeightServer(config) as upstream,
        WeightSender(upstream.publish_endpoint, config=SMALL) as sender,
    ):
        await sender.send(model(0), version=0)
        retained = upstream.store.pin(0)
        assert retained is not None
        sizes = [bucket.used for bucket in retained.buckets]
        upstream.store.unpin(0)
        served, stall = 0, anyio.Event()
        real_get = upstream.relays.get

        async def stalling_get(channel, request, timeout):  # type: ignore[no-untyped-def]
            nonlocal served
            if served == 3:  # the relay has three buckets; the fourth never comes
                stall.set()
                await anyio.sleep_forever()
            served += 1
            return await real_get(channel, request, timeout)

        upstream.relays.get = stalling_get  # type: ignore[method-assign]
        argv = [sys.executable, "-m", "aiosync", "serve", "--insecure-loopback"]
        argv += ["--upstream", upstream.control_endpoint, "--resume-dir", str(resume)]

        def start() -> subprocess.Popen[str]:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env())

        first = start()
        try:
            with anyio.fail_after(WAIT):
                await stall.wait()  # three buckets sent, the fourth asked for
                while len([p for p in resume.iterdir() if p.suffix != ".part"]) < 3:
                    await anyio.sleep(0.01)  # another process: no event to wait on
            first.kill()  # mid-version, outright
            first.wait(timeout=WAIT)
        finally:
            if first.poll() is None:
                first.kill()
            first.communicate(timeout=WAIT)
        assert upstream.relays.bytes_sent == sum(sizes[:3])
        assert len([p for p in resume.iterdir() if p.suffix != ".part"]) == 3  # by digest
        upstream.relays.get = real_get  # type: ignore[method-assign]
        second = start()
        try:
            assert second.stdout is not None
            with anyio.fail_after(WAIT):
                line = await anyio.to_thread.run_sync(second.stdout.readline)
            control = json.loads(line)["control"]
            there = empty()
            async with Subscriber(control, ModuleSink(there), name="far") as far:
                assert await far.wait_for_version(0, WAIT) == 0
            assert same(there, model(0))
            assert upstream.relays.bytes_sent == sum(sizes)  # the rest, and only the rest
            assert not list(resume.iterdir())  # retained: the saved buckets are gone
        finally:
            second.terminate()
            second.communicate(timeout=WAIT)
