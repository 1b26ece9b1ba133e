"""The collective data plane across processes (Gloo on CPU): a trainer, engine processes.

Bit-exact in both modes; an engine killed or frozen mid-broadcast, and a trainer killed
mid-broadcast, each end the version with no rank left blocked and the engines on their
previous version; a new sender (a new group) then reaches the survivors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from aiosync import AiosyncError, SenderConfig
from aiosync.core.errors import ProtocolError, UsageError
from aiosync.core.wire import CollectivePlaneSpec
from aiosync.planes.collective import CollectiveOptions, CollectiveReceiverPlane, check_spec
from aiosync.runtime import child_env
from aiosync.trainer.collective import CollectiveSender
from tests.helpers.models import digest, mixed_weights

ROOT = Path(__file__).resolve().parents[2]
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])
SMALL = 64 * 1024  # mixed_weights spans several buckets (its largest tensor is chunked)


def digests(seed: int) -> dict[str, str]:
    return {name: digest(t) for name, t in mixed_weights(seed=seed).items()}


def env() -> dict[str, str]:
    values = child_env()
    values["GLOO_SOCKET_IFNAME"] = "lo"
    return values


@pytest.fixture(autouse=True)
def gloo_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    endpoint: str = ""

    async def event(self, timeout: float = 60) -> dict[str, object]:
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            line = await anyio.to_thread.run_sync(self.proc.stdout.readline)
        assert line, f"process exited with {self.proc.poll()}"
        parsed: dict[str, object] = json.loads(line)
        return parsed

    async def until(self, kind: str, **fields: object) -> dict[str, object]:
        """The next event of ``kind`` whose fields match (others are skipped)."""
        while True:
            event = await self.event()
            if event["event"] == kind and all(event.get(k) == v for k, v in fields.items()):
                return event


@contextmanager
def processes(module: str, *argvs: list[str]) -> Iterator[list[Proc]]:
    """One process per argv; each is resumed, killed and reaped on the way out."""
    with ExitStack() as stack:
        started = []
        for argv in argvs:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=env(),
            )
            stack.callback(_stop, proc)
            started.append(Proc(proc))
        yield started


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)  # a frozen process must run to die
        proc.kill()
    proc.wait(timeout=30)
    assert proc.stdout is not None
    proc.stdout.close()


@contextmanager
def engines(*argvs: list[str]) -> Iterator[list[Proc]]:
    with processes("tests.helpers.collective_engine", *argvs) as started:
        for engine in started:
            assert engine.proc.stdout is not None
            ready = json.loads(engine.proc.stdout.readline())
            assert ready["event"] == "ready"
            engine.endpoint = str(ready["endpoint"])
        yield started


def sender(
    targets: list[Proc], *, per_tensor: bool = False, timeout: float = 30.0
) -> CollectiveSender:
    options = CollectiveOptions(engines=len(targets), per_tensor=per_tensor, timeout=timeout)
    config = SenderConfig(buffer_bytes=SMALL, timeout=timeout)
    return CollectiveSender([t.endpoint for t in targets], collective=options, config=config)


# --- the spec is hostile input -----------------------------------------------------------

GOOD = CollectivePlaneSpec(
    "gloo", "127.0.0.1", 1234, "ab" * 16, "aiosync-g", 3, 2, 4096, secret="cd" * 32
)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("backend", "mpi", "backend"),
        ("host", "evil.example.com", "not an IP address"),
        ("port", 0, "port"),
        ("token", "ab" * 15, "token"),
        ("group", "../x", "group name"),
        ("group", "", "group name"),
        ("world_size", 1, "world size"),
        ("world_size", 1 << 20, "world size"),
        ("count", 0, "buffers"),
        ("count", 65, "buffers"),
        ("capacity", 0, "buffers"),
        ("capacity", 1 << 40, "bytes of buffers"),
        ("timeout_ms", 0, "timeout"),
    ],
)
def test_a_hostile_spec_is_refused_before_anything_opens(
    field: str, value: object, says: str
) -> None:
    check_spec(GOOD)
    bad = msgspec.structs.replace(GOOD, **{field: value})
    with pytest.raises(ProtocolError, match=says):
        check_spec(bad)
    with pytest.raises(ProtocolError, match=says):
        CollectiveReceiverPlane(bad, torch.device("cpu"))


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="engines"):
        CollectiveOptions(engines=0)
    with pytest.raises(ValueError, match="backend"):
        CollectiveOptions(engines=1, backend="mpi")
    with pytest.raises(ValueError, match="IP address"):
        CollectiveOptions(engines=1, host="0.0.0.0.0")


# --- across processes -------------------------------------------------------------------


@only_asyncio
async def test_both_modes_fan_out_bit_exact_to_four_engines_with_a_new_group_each() -> None:
    with engines([], [], [], []) as fleet:
        for version, per_tensor in ((0, False), (1, True), (2, False)):
            async with sender(fleet, per_tensor=per_tensor) as trainer:  # a new group each
                report = await trainer.send(mixed_weights(seed=version + 1), version=version)
            assert sorted(report.committed) == sorted(e.endpoint for e in fleet)
            for engine in fleet:
                committed = await engine.until("committed")
                assert committed["version"] == version
                assert committed["digests"] == digests(version + 1)


async def _ends_on_previous_version(survivor: Proc) -> None:
    """The survivor failed version 1 (its receive returned) and still serves version 0."""
    failed = await survivor.until("failed", version=1)
    assert failed["current"] == 0
    assert failed["digests"] == digests(1)


@only_asyncio
@pytest.mark.parametrize("how", ["killed", "frozen"])
async def test_an_engine_lost_mid_broadcast_ends_the_version_for_all(how: str) -> None:
    with engines(["--slow-version", "1", "--delay", "20"], []) as (lost, survivor):
        async with sender([lost, survivor], timeout=3.0) as trainer:
            await trainer.send(mixed_weights(seed=1), version=0)
            for engine in (lost, survivor):
                assert (await engine.until("committed"))["version"] == 0
            async with anyio.create_task_group() as tg:

                async def stop_on_first_bucket() -> None:
                    await lost.until("applying", version=1)  # bucket 2 is being broadcast
                    os.kill(lost.proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)

                tg.start_soon(stop_on_first_bucket)
                with anyio.fail_after(60), pytest.raises(AiosyncError) as caught:
                    await trainer.send(mixed_weights(seed=2), version=1)
            assert lost.endpoint in str(caught.value)
        await _ends_on_previous_version(survivor)
        # the survivor takes a new group at once
        async with sender([survivor]) as again:
            await again.send(mixed_weights(seed=3), version=1)
        assert (await survivor.until("committed"))["digests"] == digests(3)


@only_asyncio
async def test_a_trainer_killed_mid_broadcast_leaves_engines_on_their_version() -> None:
    slow = ["--slow-version", "1", "--delay", "1", "--timeout", "5"]
    with engines(slow, ["--timeout", "5"]) as pair:
        args = [e.endpoint for e in pair]
        with processes("tests.helpers.collective_trainer", args) as (trainer,):
            assert (await trainer.until("sent"))["version"] == 0
            await pair[0].until("applying", version=1)
            trainer.proc.kill()
            for engine in pair:
                await _ends_on_previous_version(engine)
        async with sender(pair) as again:  # a new trainer reaches both
            await again.send(mixed_weights(seed=3), version=1)
        for engine in pair:
            assert (await engine.until("committed"))["digests"] == digests(3)


def test_a_gloo_plane_has_no_events_and_a_failed_rendezvous_fails_the_receive() -> None:
    spec = msgspec.structs.replace(GOOD, port=1, timeout_ms=200)
    plane = CollectiveReceiverPlane(spec, torch.device("cpu"))  # opening never blocks
    try:
        assert plane.events == []  # Gloo: sinks keep their own device waits
        with pytest.raises(AiosyncError, match="deadline"):
            plane.view(0, 64)  # nobody listens on port 1
        with pytest.raises(AiosyncError):
            plane.view(1, 64)  # the group stays broken
    finally:
        plane.close()


def test_the_engines_given_must_fill_the_group() -> None:
    with pytest.raises(UsageError, match="2 engines given for a group of 3"):
        CollectiveSender(["ipc:///a", "ipc:///b"], collective=CollectiveOptions(engines=3))
    CollectiveSender((), collective=CollectiveOptions(engines=3))  # added later: not checked


@only_asyncio
@pytest.mark.parametrize("per_tensor", [False, True])
async def test_an_engine_that_refuses_still_joins_so_the_others_commit(per_tensor: bool) -> None:
    with engines([], []) as (ahead, behind):
        async with sender([ahead]) as first:  # only one engine: it gets ahead, at version 5
            await first.send(mixed_weights(seed=1), version=5)
        assert (await ahead.until("committed"))["version"] == 5
        async with sender([ahead, behind], per_tensor=per_tensor) as trainer:
            report = await trainer.send(mixed_weights(seed=2), version=3, policy="available")
            assert report.committed == [behind.endpoint]  # every broadcast completed
            (refused,) = [o for o in report.engines if o.engine == ahead.endpoint]
            assert refused.status == "failed"
            assert "version 3 is not newer than" in str(refused.error)
            failed = await ahead.until("failed", version=3)
            assert failed["current"] == 5  # it keeps its version
            assert failed["digests"] == digests(1)
            committed = await behind.until("committed")
            assert (committed["version"], committed["digests"]) == (3, digests(2))
            await trainer.send(mixed_weights(seed=3), version=6)  # the group is still whole
        for engine in (ahead, behind):
            committed = await engine.until("committed")
            assert (committed["version"], committed["digests"]) == (6, digests(3))


@only_asyncio
@pytest.mark.parametrize("policy", ["available", "all"])
async def test_an_engine_refusing_mid_version_still_joins_the_rest_of_it(policy: str) -> None:
    with engines(["--refuse-version", "1"], []) as (refusing, other):
        async with sender([refusing, other]) as trainer:
            await trainer.send(mixed_weights(seed=1), version=0)
            if policy == "available":
                report = await trainer.send(mixed_weights(seed=2), version=1, policy=policy)
                assert report.committed == [other.endpoint]
            else:  # nobody commits; the broadcasts already published are still joined
                with pytest.raises(AiosyncError, match="refused on purpose"):
                    await trainer.send(mixed_weights(seed=2), version=1, policy=policy)
                assert (await other.until("failed", version=1))["current"] == 0
            failed = await refusing.until("failed", version=1)
            assert "refused on purpose" in str(failed["reason"])
            assert (failed["current"], failed["digests"]) == (0, digests(1))
            await trainer.send(mixed_weights(seed=3), version=2)  # the same group, whole
        for engine in (refusing, other):
            committed = await engine.until("committed", version=2)
            assert committed["digests"] == digests(3)
