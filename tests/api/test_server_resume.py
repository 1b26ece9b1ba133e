"""Engine-level resume (issue 12, item 4): an engine whose transfer broke mid-version, or
whose process was killed, comes back and is sent only the buckets it does not hold; its
store is checked, bounded and cleaned; hostile claims and corrupted files never give wrong
weights.

The server side runs in this process on the real channels (ZMQ over ipc) and shared
memory; the killed engine is a process (``tests/helpers/server_engine.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import aiosync.server.feed as feed
from aiosync import ModuleSink, ReceiverConfig, SenderConfig, WeightSender
from aiosync.channels.base import Channel
from aiosync.core.errors import AiosyncError, PeerGoneError
from aiosync.core.wire import Bucket, decode
from aiosync.engine.held import HeldBuckets, bucket_digest
from aiosync.server import ServerConfig, Subscriber, WeightServer
from aiosync.server import messages as m
from aiosync.server.fleet import SubscriberState
from tests.api.test_server import SMALL, empty, model, same

WAIT = 30.0
ROOT = Path(__file__).resolve().parents[2]


class Dropping:
    """A channel whose connection breaks as it is about to send bucket ``after + 1``.

    ``silent``: nothing sent after that reaches the engine (not even the abort).
    """

    def __init__(self, channel: Channel, after: int, silent: bool) -> None:
        self._channel, self.left, self.silent = channel, after, silent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    async def send(self, payload: bytes) -> None:
        if self.left < 0 and self.silent:
            return
        if isinstance(decode(payload), Bucket):
            if self.left == 0:
                self.left = -1
                raise PeerGoneError("connection dropped (test)")
            self.left -= 1
        await self._channel.send(payload)


@asynccontextmanager
async def dropping_once(after: int, silent: bool = False) -> AsyncIterator[None]:
    """The server's next transfer breaks after ``after`` buckets; later ones are whole."""
    real = feed.send_version
    calls = 0

    async def send_version(channel: Channel, *args: Any, **kwargs: Any) -> feed.Transfer:
        nonlocal calls
        calls += 1
        if calls == 1:
            channel = Dropping(channel, after, silent)  # type: ignore[assignment]
        return await real(channel, *args, **kwargs)

    feed.send_version = send_version  # type: ignore[assignment]
    try:
        yield
    finally:
        feed.send_version = real


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(WAIT):
        while not condition():
            await anyio.sleep(0.01)


async def subscribed(server: WeightServer, name: str) -> SubscriberState:
    await until(lambda: name in server.fleet.subscribers)
    return server.fleet.subscribers[name]


def buckets_of(server: WeightServer, version: int) -> list[tuple[bytes, int]]:
    """(digest, bytes) of each bucket of a retained version."""
    retained = server.store.pin(version)
    assert retained is not None
    try:
        return [(d, b.used) for d, b in zip(retained.digests(), retained.buckets, strict=True)]
    finally:
        server.store.unpin(version)


Run = Callable[[WeightServer, WeightSender], Awaitable[None]]


async def with_server(body: Run) -> None:
    async with (
        WeightServer(ServerConfig(timeout=WAIT)) as server,
        WeightSender(server.publish_endpoint, config=SMALL) as sender,
    ):
        await body(server, sender)


# --- (a) a dropped connection: resubscribe, and only the rest is sent --------------------


async def test_a_dropped_transfer_resumes_with_only_the_missing_buckets() -> None:
    async def body(server: WeightServer, sender: WeightSender) -> None:
        await sender.send(model(0), version=0)
        buckets = buckets_of(server, 0)
        assert len(buckets) >= 4
        k = 2
        there = empty()
        async with dropping_once(after=k):
            sub = Subscriber(server.control_endpoint, ModuleSink(there), name="e", resume=True)
            async with sub:
                first = await subscribed(server, "e")
                held = sub.held
                assert held is not None
                await until(lambda: "e" not in server.fleet.subscribers)  # dropped
                await until(lambda: len(held.digests()) == k)
                assert sub.current_version is None
                assert held.digests() == [digest for digest, _ in buckets[:k]]
                assert not await sub.subscribed()  # what an engine asks to find out
                await sub.resubscribe(WAIT)
                assert await sub.subscribed()
                second = await subscribed(server, "e")
                assert await sub.wait_for_version(0, WAIT) == 0
                await until(lambda: not held.digests())  # cleaned once committed
        assert same(there, model(0))  # bit-exact
        assert first.bytes_sent == sum(used for _, used in buckets[:k])
        assert second.bytes_sent == sum(used for _, used in buckets[k:])  # only the rest
        assert second.bytes_held == sum(used for _, used in buckets[:k])
        assert held.nbytes == 0

    await with_server(body)


async def test_a_silent_break_resumes_once_the_engine_drops_the_old_stream() -> None:
    """The engine never hears that the transfer broke: its old stream holds the sink (the
    server is told busy and tries again) until it expires; then only the rest is sent."""

    async def body(server: WeightServer, sender: WeightSender) -> None:
        await sender.send(model(0), version=0)
        buckets = buckets_of(server, 0)
        k, there = 2, empty()
        expiring = ReceiverConfig(stream_timeout=3.0)
        async with (
            dropping_once(after=k, silent=True),
            Subscriber(
                server.control_endpoint, ModuleSink(there), name="e", resume=True, config=expiring
            ) as sub,
        ):
            await until(lambda: "e" not in server.fleet.subscribers)
            await until(lambda: sub.held is not None and len(sub.held.digests()) == k)
            await sub.resubscribe(WAIT)
            state = await subscribed(server, "e")
            assert await sub.wait_for_version(0, WAIT) == 0
            failures = sub.receiver.failures
        assert same(there, model(0))
        assert "no progress" in failures[0].reason  # the old stream expired on its own
        assert state.bytes_sent == sum(used for _, used in buckets[k:])
        assert state.bytes_held == sum(used for _, used in buckets[:k])

    await with_server(body)


async def test_held_buckets_of_an_older_version_serve_a_newer_one() -> None:
    """Resuming into a newer version: unchanged buckets the engine kept are not sent."""

    async def body(server: WeightServer, sender: WeightSender) -> None:
        await sender.send(model(0), version=0)
        old = buckets_of(server, 0)
        there, k = empty(), len(old) - 1  # all but the last bucket arrive
        async with (
            dropping_once(after=k),
            Subscriber(server.control_endpoint, ModuleSink(there), name="e", resume=True) as sub,
        ):
            await until(lambda: sub.held is not None and len(sub.held.digests()) == k)
            await until(lambda: "e" not in server.fleet.subscribers)
            weights = model(0)
            weights["layer.0.bias"] += 1  # one bucket changes
            await sender.send(weights, version=1)
            await sub.resubscribe(WAIT)
            state = await subscribed(server, "e")
            assert await sub.wait_for_version(1, WAIT) == 1
        assert same(there, weights)
        new = buckets_of(server, 1)
        kept = {digest for digest, _ in old[:k]}
        assert state.bytes_held == sum(used for d, used in new if d in kept) > 0
        assert state.bytes_sent == sum(used for d, used in new if d not in kept)

    await with_server(body)


# --- (c) hostile claims and corrupted files --------------------------------------------


class Claiming(HeldBuckets):
    """A store that claims digests it does not hold."""

    def __init__(self, claims: list[bytes]) -> None:
        super().__init__()
        self.claims = claims

    def digests(self) -> list[bytes]:
        return list(self.claims)


async def test_claimed_buckets_it_does_not_hold_end_in_correct_weights() -> None:
    async def body(server: WeightServer, sender: WeightSender) -> None:
        await sender.send(model(0), version=0)
        buckets = buckets_of(server, 0)
        total = sum(used for _, used in buckets)
        there = empty()
        liar = Claiming([digest for digest, _ in buckets])  # every bucket: none held
        async with Subscriber(
            server.control_endpoint, ModuleSink(there), name="liar", resume=liar
        ) as sub:
            state = await subscribed(server, "liar")
            assert await sub.wait_for_version(0, WAIT) == 0
            failures = sub.receiver.failures
        assert same(there, model(0))  # the server sent it again, whole
        assert state.bytes_sent == total
        assert len(failures) == 1
        assert "bucket 1 (" in failures[0].reason  # the error names the bucket
        assert "holds no such bucket" in failures[0].reason

    await with_server(body)


async def test_garbage_claims_are_just_not_held() -> None:
    async def body(server: WeightServer, sender: WeightSender) -> None:
        await sender.send(model(0), version=0)
        total = sum(used for _, used in buckets_of(server, 0))
        junk = [os.urandom(32) for _ in range(m.MAX_HELD + 100)]  # more than are read
        junk += [b"", b"x" * 33, os.urandom(31)]
        there = empty()
        async with Subscriber(
            server.control_endpoint, ModuleSink(there), name="junk", resume=Claiming(junk)
        ) as sub:
            state = await subscribed(server, "junk")
            assert len(state.held) <= m.MAX_HELD
            assert await sub.wait_for_version(0, WAIT) == 0
            assert not sub.receiver.failures  # nothing unknown was named as held
        assert same(there, model(0))
        assert (state.bytes_sent, state.bytes_held) == (total, 0)

    await with_server(body)
    assert m.held_digests([b"a" * 32, b"b" * 31, b"c" * 32, b"a" * 32]) == {b"a" * 32, b"c" * 32}


async def test_a_corrupted_file_is_sent_again_and_foreign_files_are_left(tmp_path: Path) -> None:
    directory = tmp_path / "resume"

    async def body(server: WeightServer, sender: WeightSender) -> None:
        await sender.send(model(0), version=0)
        buckets = buckets_of(server, 0)
        k = 3
        there = empty()
        async with dropping_once(after=k):
            sub = Subscriber(
                server.control_endpoint, ModuleSink(there), name="e", resume_dir=directory
            )
            async with sub:
                await until(lambda: "e" not in server.fleet.subscribers)
                await until(lambda: len(list(directory.iterdir())) == k)
                assert directory.stat().st_mode & 0o777 == 0o700
                for path in directory.iterdir():
                    assert path.stat().st_mode & 0o777 == 0o600
                bad = directory / buckets[1][0].hex()
                raw = bytearray(bad.read_bytes())
                raw[0] ^= 0xFF
                bad.write_bytes(bytes(raw))  # same size, wrong content
                (directory / "notes.txt").write_text("not a bucket")
                await sub.resubscribe(WAIT)
                state = await subscribed(server, "e")
                assert await sub.wait_for_version(0, WAIT) == 0
                failures = sub.receiver.failures
                assert sub.held is not None
                assert sub.held.refused == 1
        assert same(there, model(0))  # never the corrupted bytes
        assert "bucket 2 (" in failures[-1].reason  # named, then sent again whole
        assert state.bytes_sent >= sum(used for _, used in buckets)
        assert [p.name for p in directory.iterdir()] == ["notes.txt"]  # ours gone, foreign kept

    await with_server(body)


# --- the store itself -------------------------------------------------------------------


def bucket(seed: int, size: int = 1000) -> tuple[bytes, torch.Tensor]:
    data = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return bucket_digest(data), data


def test_the_store_checks_bounds_and_cleans(tmp_path: Path) -> None:
    store = HeldBuckets(tmp_path / "d", max_bytes=2500)
    (d0, b0), (d1, b1), (d2, b2), (d3, b3) = (bucket(i) for i in range(4))
    assert store.put(0, d0, b0)
    assert store.put(0, d1, b1)
    assert not store.put(0, d2, b2)  # over max_bytes, and nothing older to drop
    assert not store.put(0, b"short", b2)
    assert store.put(1, d2, b2)  # a newer version: the older one's buckets go first
    assert store.digests() == [d1, d2]
    assert store.put(2, d3, b3)  # a third version: only two are kept
    assert set(store.digests()) == {d2, d3}
    taken = store.take(2, d3, 1000)
    assert taken is not None
    assert torch.equal(taken, b3)
    assert store.take(2, d3, 999) is None  # the wrong size: dropped
    assert store.take(2, d0, 1000) is None
    assert store.take(3, d2, 1000) is not None  # a bucket of version 1 serves version 3
    assert store.digests() == [d2]  # and is kept for it; version 2's went
    # a new process finds the files; a partial write and a foreign file are not buckets
    (tmp_path / "d" / (d0.hex() + ".part")).write_bytes(b"partial")
    (tmp_path / "d" / "foreign").write_bytes(b"x")
    (tmp_path / "elsewhere").write_bytes(bytes(1000))
    (tmp_path / "d" / ("ab" * 32)).symlink_to(tmp_path / "elsewhere")  # never followed
    os.mkfifo(tmp_path / "d" / ("cd" * 32))  # never opened
    again = HeldBuckets(tmp_path / "d", max_bytes=2500)
    assert again.digests() == [d2]
    assert not (tmp_path / "d" / ("ab" * 32)).is_symlink()
    assert not (tmp_path / "d" / ("cd" * 32)).exists()
    assert (tmp_path / "elsewhere").exists()
    assert again.version is None
    assert not (tmp_path / "d" / (d0.hex() + ".part")).exists()
    (tmp_path / "d" / d2.hex()).write_bytes(bytes(1000))  # corrupted on disk
    assert again.take(5, d2, 1000) is None
    assert again.refused == 1
    assert not again.digests()
    again.clear()
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["foreign"]


def test_the_store_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(AiosyncError, match="0700"):
        HeldBuckets(open_dir)


# --- (b) an engine process killed mid-stream, restarted with the same directory ---------


def test_a_killed_engine_restarted_is_sent_only_the_missing_buckets(tmp_path: Path) -> None:
    anyio.run(killed_engine_resumes, tmp_path)  # once, on asyncio: the processes are slow


async def event(proc: subprocess.Popen[str], name: str) -> dict[str, Any]:
    assert proc.stdout is not None
    with anyio.fail_after(WAIT * 2):
        while True:
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
            assert line, f"engine exited with {proc.poll()} before {name!r}"
            found: dict[str, Any] = json.loads(line)
            if found["event"] == name:
                return found


async def killed_engine_resumes(tmp_path: Path) -> None:
    from aiosync.bench.model import synthetic_state_dict, tensor_digest
    from aiosync.runtime import child_env

    resume = tmp_path / "resume"
    weights = synthetic_state_dict(1 << 20)
    config = SenderConfig(buffer_bytes=128 << 10, num_buffers=2, timeout=WAIT)
    async with (
        WeightServer(ServerConfig(timeout=WAIT)) as server,
        WeightSender(server.publish_endpoint, config=config) as sender,
    ):
        await sender.send(weights, version=0)
        buckets = buckets_of(server, 0)
        assert len(buckets) >= 6

        def start(name: str, *more: str) -> subprocess.Popen[str]:
            argv = [sys.executable, "-m", "tests.helpers.server_engine", "--control"]
            argv += [server.control_endpoint, "--name", name, "--size-mb", "1"]
            argv += ["--resume-dir", str(resume), "--until", "0", *more]
            return subprocess.Popen(
                argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=child_env()
            )

        first = start("e1", "--stall-after", "3")
        try:
            await event(first, "stalled")  # three buckets kept; the fourth never finishes
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=WAIT)
        finally:
            if first.poll() is None:
                first.kill()
            first.communicate(timeout=WAIT)
        saved = {bytes.fromhex(p.name) for p in resume.iterdir()}
        assert saved == {digest for digest, _ in buckets[:3]}
        second = start("e2")
        try:
            await event(second, "ready")
            state = await subscribed(server, "e2")
            done = await event(second, "digest")
            assert second.wait(timeout=WAIT) == 0
        finally:
            if second.poll() is None:
                second.kill()
            second.communicate(timeout=WAIT)
        assert done["digest"] == tensor_digest(weights)  # bit-exact
        assert state.bytes_sent == sum(used for d, used in buckets if d not in saved)
        assert state.bytes_held == sum(used for d, used in buckets if d in saved)
        assert not list(resume.iterdir())  # committed: the store is clean
