"""Side process groups and the group executor: rendezvous rules, coexistence, deadlines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist

from aiosync.collectives import (
    Deadline,
    GroupExecutor,
    HostedStore,
    host_store,
    init_process_group,
    new_token,
    token_store,
)
from aiosync.collectives.ops import broadcast
from aiosync.collectives.rendezvous import is_token, valid_host
from aiosync.core.errors import PeerGoneError, SyncTimeoutError, UsageError
from tests.helpers.peer_processes import process

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


@contextmanager
def hosted_peer(token: str, name: str) -> Iterator[tuple[HostedStore, subprocess.Popen[str]]]:
    """A store on loopback and a ``hold`` worker that joins group ``name`` through it."""
    with (
        host_store(timeout=timedelta(seconds=60)) as hosted,
        worker("hold", str(hosted.port), token, name, "60", stdin=True) as peer,
    ):
        yield hosted, peer


def worker(*argv: str, stdin: bool = False) -> AbstractContextManager[subprocess.Popen[str]]:
    """One ``tests.helpers.collective_worker`` process (Gloo on loopback), killed and reaped at
    the end."""
    return process(
        "tests.helpers.collective_worker", *argv, env={"GLOO_SOCKET_IFNAME": "lo"}, stdin=stdin
    )


def event(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited with {proc.wait(timeout=30)}"
    parsed: dict[str, object] = json.loads(line)
    return parsed


async def event_async(proc: subprocess.Popen[str]) -> dict[str, object]:
    with anyio.fail_after(60):
        return await anyio.to_thread.run_sync(event, proc)


def say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.fixture(autouse=True)
def gloo_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


# --- the rules, without processes --------------------------------------------------------


def test_store_and_init_method_together_is_a_value_error() -> None:
    with (
        host_store(timeout=timedelta(seconds=5)) as hosted,
        pytest.raises(ValueError, match="either store or init_method"),
    ):
        init_process_group(
            "gloo", init_method="tcp://127.0.0.1:1", store=hosted.store, world_size=1, rank=0
        )


@pytest.mark.parametrize(("world_size", "rank"), [(-1, 0), (2, 2), (2, -1)])
def test_a_store_needs_a_world_size_and_a_rank_inside_it(world_size: int, rank: int) -> None:
    with (
        host_store(timeout=timedelta(seconds=5)) as hosted,
        pytest.raises(ValueError, match=r"rank|world_size"),
    ):
        init_process_group("gloo", store=hosted.store, world_size=world_size, rank=rank)


def test_a_one_rank_side_group_works_and_is_not_the_default() -> None:
    with host_store(timeout=timedelta(seconds=5)) as hosted:
        name = f"solo-{uuid.uuid4().hex}"
        group = init_process_group(
            "gloo", store=token_store(hosted.store, new_token()), world_size=1, rank=0,
            group_name=name,
        )  # fmt: skip
        try:
            assert not dist.is_initialized()  # no default world was made
            values = torch.arange(3.0)
            dist.all_reduce(values, group=group)
            assert values.tolist() == [0.0, 1.0, 2.0]
            with pytest.raises(ValueError, match="already been created"):  # one group a name
                init_process_group(
                    "gloo", store=hosted.store, world_size=1, rank=0, group_name=name
                )
        finally:
            dist.destroy_process_group(group)


def test_the_store_listens_on_loopback_only() -> None:
    with host_store(timeout=timedelta(seconds=5)) as hosted:
        listening = _listeners(hosted.port)
        assert listening == {"127.0.0.1"}
        # torch's own server socket would have listened on every interface
        with socket.create_connection(("127.0.0.1", hosted.port), timeout=5):
            pass


def _listeners(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                if len(address) == 8:
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    found.add("ipv6:" + address)
    return found


def test_tokens_and_hosts_are_checked() -> None:
    token = new_token()
    assert is_token(token)
    assert token != new_token()
    for bad in ("", "x" * 32, token[:-1], token.upper(), "../" + token[3:]):
        assert not is_token(bad)
        with pytest.raises(ValueError, match="token"):
            token_store(dist.HashStore(), bad)
    assert valid_host("::1") == "::1"
    for bad in ("localhost", "127.0.0.1; rm", ""):
        with pytest.raises(ValueError, match="not an IP address"):
            valid_host(bad)


# --- the executor, without processes -----------------------------------------------------


def test_deadlines_are_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Deadline.after(0)
    deadline = Deadline.after(60)
    assert 0 < deadline.remaining() <= 60
    assert not deadline.expired


@only_asyncio
async def test_jobs_run_in_order_on_one_thread_off_the_loop() -> None:
    seen: list[tuple[int, str]] = []
    async with GroupExecutor("order") as executor:
        futures = [
            executor.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
            for i in range(50)
        ]
        await executor.wait(futures[-1], deadline=Deadline.after(60))
        assert await executor.run(lambda: 7, deadline=Deadline.after(60)) == 7
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"aiosync-group-order"}
    with pytest.raises(UsageError):
        executor.submit(lambda: None)


@only_asyncio
async def test_a_failed_job_breaks_the_group_for_every_later_call() -> None:
    def boom() -> None:
        raise RuntimeError("Connection reset by peer")

    async with GroupExecutor("fails") as executor:
        with pytest.raises(PeerGoneError, match="Connection reset") as caught:
            await executor.run(boom, deadline=Deadline.after(60), peers=["engine-a"])
        assert caught.value.peer == "engine-a"
        assert executor.broken is caught.value
        with pytest.raises(PeerGoneError):
            executor.submit(lambda: None)


@only_asyncio
async def test_a_job_past_the_deadline_raises_naming_the_engines_and_the_loop_runs() -> None:
    release = threading.Event()
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.005)
            ticks += 1

    async with GroupExecutor("late", join_timeout=30) as executor:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat)
                with pytest.raises(SyncTimeoutError) as caught:
                    await executor.run(
                        lambda: release.wait(60),
                        deadline=Deadline.after(0.3),
                        what="broadcast of bucket 1",
                        peers=["engine-a", "engine-b"],
                    )
                tg.cancel_scope.cancel()
        finally:
            release.set()
    assert caught.value.peer == "engine-a, engine-b"
    assert "bucket 1" in str(caught.value)
    assert "0.3s deadline" in str(caught.value)
    assert ticks >= 10  # the loop kept ticking while the job was blocked


# --- across processes -------------------------------------------------------------------


def test_a_default_world_and_two_side_groups_coexist(tmp_path: Path) -> None:
    token = new_token()
    with host_store(timeout=timedelta(seconds=30)) as hosted:
        port = str(hosted.port)
        with (
            worker("worlds", "0", port, token, str(tmp_path)) as a,
            worker("worlds", "1", port, token, str(tmp_path)) as b,
        ):
            first, second = event(a), event(b)
            for result, rank in ((first, 0), (second, 1)):
                assert result["event"] == "worlds"
                assert result["rank"] == rank
                assert result["world"] == 6.0  # (1 + 2), reduced twice across the world
                assert result["s1"] == 10.0  # from s1's rank 0, which is world rank 1
                assert result["s2"] == 100.0
                assert result["default_size"] == 2
                assert result["default_is_side"] is False
                assert result["s1_rank"] == 1 - rank
            assert event(a) == {"event": "done", "world": 12.0}
            assert event(b) == {"event": "done", "world": 12.0}
            assert a.wait(timeout=60) == 0
            assert b.wait(timeout=60) == 0


def _join(hosted_store: dist.Store, token: str, name: str, timeout: float) -> dist.ProcessGroup:
    return init_process_group(
        "gloo",
        store=token_store(hosted_store, token),
        world_size=2,
        rank=0,
        group_name=name,
        timeout=timedelta(seconds=timeout),
    )


@only_asyncio
async def test_the_loop_keeps_ticking_while_a_collective_is_held_blocked() -> None:
    token, name = new_token(), f"hold-{uuid.uuid4().hex}"
    with hosted_peer(token, name) as (hosted, peer):
        async with GroupExecutor(name, join_timeout=60) as executor:
            deadline = Deadline.after(120)
            executor.group = await executor.run(
                lambda: _join(hosted.store, token, name, 60), deadline=deadline
            )
            assert (await event_async(peer))["event"] == "joined"
            values = torch.arange(4.0)
            group = executor.group
            held = executor.submit(lambda: broadcast(group, values, 0, deadline))
            gaps = []
            last = time.monotonic()
            for _ in range(40):  # the peer has not joined the broadcast yet
                await anyio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
            assert not held.done()
            assert max(gaps) < 0.5  # 50x the tick: the loop was never held
            say(peer, "go")
            await executor.wait(held, deadline=deadline)
            assert (await event_async(peer))["values"] == [0.0, 1.0, 2.0, 3.0]


@only_asyncio
async def test_a_gloo_collective_past_the_deadline_ends_and_a_new_group_works() -> None:
    token, name = new_token(), f"late-{uuid.uuid4().hex}"
    with hosted_peer(token, name) as (hosted, peer):
        executor = GroupExecutor(name, join_timeout=30)
        async with executor:
            executor.group = await executor.run(
                lambda: _join(hosted.store, token, name, 60), deadline=Deadline.after(120)
            )
            assert (await event_async(peer))["event"] == "joined"
            values = torch.arange(4.0)
            group = executor.group
            deadline = Deadline.after(1.0)
            with pytest.raises(SyncTimeoutError) as caught:
                await executor.run(
                    lambda: broadcast(group, values, 0, deadline),
                    deadline=deadline,
                    peers=["engine-1"],
                )
            assert caught.value.peer == "engine-1"
            with pytest.raises(SyncTimeoutError):
                executor.submit(lambda: None)  # broken: fails at once
        assert not executor.alive  # Gloo's per-operation timeout let the thread end
    # reconnect: a new group (new token and name) with a fresh peer
    token, name = new_token(), f"again-{uuid.uuid4().hex}"
    with hosted_peer(token, name) as (hosted, peer):
        async with GroupExecutor(name, join_timeout=30) as executor:
            deadline = Deadline.after(120)
            executor.group = await executor.run(
                lambda: _join(hosted.store, token, name, 60), deadline=deadline
            )
            assert (await event_async(peer))["event"] == "joined"
            say(peer, "go")
            values = torch.arange(4.0)
            group = executor.group
            await executor.run(lambda: broadcast(group, values, 0, deadline), deadline=deadline)
            assert (await event_async(peer))["values"] == [0.0, 1.0, 2.0, 3.0]
