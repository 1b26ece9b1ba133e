"""One trainer, several engine processes: fan-out, and the commit policies under faults."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import torch

from aiosync import PeerGoneError, Policy, RejectedError, SenderConfig, WeightSender
from aiosync.runtime import child_env
from tests.helpers.models import digest, mixed_weights

ROOT = Path(__file__).resolve().parents[2]
SMALL = SenderConfig(buffer_bytes=64 * 1024, timeout=30)
only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    endpoint: str

    async def event(self, timeout: float = 60) -> dict[str, object]:
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            line = await anyio.to_thread.run_sync(self.proc.stdout.readline)
        assert line, f"engine exited with {self.proc.poll()}"
        event: dict[str, object] = json.loads(line)
        return event

    async def next_commit(self) -> dict[str, object]:
        while (event := await self.event())["event"] != "committed":
            pass
        return event


@contextmanager
def engine_processes(*argvs: list[str]) -> Iterator[list[Engine]]:
    """Start one engine process per argv; each is killed on the way out."""
    with ExitStack() as stack:
        engines = []
        for argv in argvs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.fleet_engine", *argv],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=child_env(),
            )
            stack.callback(_stop, proc)
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            assert ready["event"] == "ready"
            engines.append(Engine(proc, str(ready["endpoint"])))
        yield engines


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    assert proc.stdout is not None
    proc.stdout.close()


def digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest(tensor) for name, tensor in weights.items()}


@only_asyncio
@pytest.mark.parametrize("count", [1, 2, 4])
async def test_fan_out_is_bit_exact_on_every_engine(count: int) -> None:
    with engine_processes(*([[]] * count)) as engines:
        async with WeightSender([e.endpoint for e in engines], config=SMALL) as sender:
            for version in (0, 1):
                weights = mixed_weights(seed=version + 1)
                report = await sender.send(weights, version=version)
                assert sorted(report.committed) == sorted(e.endpoint for e in engines)
                assert all(o.version == version for o in report.engines)
                for engine in engines:
                    committed = await engine.next_commit()
                    assert committed["version"] == version
                    assert committed["digests"] == digests(weights)


@only_asyncio
async def test_a_refused_manifest_leaves_every_engine_behind_under_all() -> None:
    with engine_processes([], ["--extra", "only.here"]) as (good, picky):
        async with WeightSender([good.endpoint, picky.endpoint], config=SMALL) as sender:
            with pytest.raises(RejectedError) as caught:
                await sender.send(mixed_weights(seed=1), version=0)
            assert caught.value.peer == picky.endpoint
            assert "only.here" in str(caught.value)
            await sender.remove_engine(picky.endpoint)
            weights = mixed_weights(seed=2)
            await sender.send(weights, version=1)
        first = await good.next_commit()  # version 0 never committed anywhere
        assert first["version"] == 1
        assert first["digests"] == digests(weights)


@only_asyncio
async def test_a_refused_manifest_commits_the_others_under_available() -> None:
    with engine_processes([], ["--extra", "only.here"]) as (good, picky):
        async with WeightSender([good.endpoint, picky.endpoint], config=SMALL) as sender:
            weights = mixed_weights(seed=1)
            report = await sender.send(weights, version=0, policy=Policy.AVAILABLE)
            assert report.committed == [good.endpoint]
            [refused] = report.failed
            assert refused.engine == picky.endpoint
            assert refused.status == "failed"
            assert refused.error is not None
            assert "only.here" in refused.error
        committed = await good.next_commit()
        assert committed["version"] == 0
        assert committed["digests"] == digests(weights)


@only_asyncio
@pytest.mark.parametrize("policy", [Policy.ALL, Policy.AVAILABLE])
async def test_an_engine_killed_mid_stream(policy: Policy) -> None:
    """The sender names the dead engine at once; the survivor ends as the policy says."""
    with engine_processes([], ["--delay", "0.5"]) as (good, doomed):
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=600, policy=policy)
        async with WeightSender([good.endpoint, doomed.endpoint], config=config) as sender:

            async def kill_on_first_bucket() -> None:
                while (await doomed.event())["event"] != "applying":
                    pass
                doomed.proc.send_signal(signal.SIGKILL)

            weights = mixed_weights(seed=1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_on_first_bucket)
                with anyio.fail_after(60):  # far below the 600 s timeout: noticed, not waited
                    if policy is Policy.ALL:
                        with pytest.raises(PeerGoneError) as caught:
                            await sender.send(weights, version=0)
                        assert caught.value.peer == doomed.endpoint
                    else:
                        report = await sender.send(weights, version=0)
                        assert report.committed == [good.endpoint]
                        assert [f.engine for f in report.failed] == [doomed.endpoint]
            assert sender.engines == [good.endpoint], (sender.engines, sender.lost_engines)
            assert doomed.endpoint in sender.lost_engines
            later = mixed_weights(seed=2)
            await sender.send(later, version=1)
        committed = await good.next_commit()
        if policy is Policy.AVAILABLE:
            assert committed["version"] == 0
            assert committed["digests"] == digests(weights)
            committed = await good.next_commit()
        assert committed["version"] == 1
        assert committed["digests"] == digests(later)


@only_asyncio
@pytest.mark.parametrize("flaw", ["missing", "unknown"])
async def test_a_bad_version_is_refused_before_any_byte_moves(flaw: str) -> None:
    """An engine process with an in-place model: untouched, still servable, same version."""
    with engine_processes([]) as (engine,):
        weights = mixed_weights(seed=1)
        if flaw == "missing":
            del weights["layer.0.norm.weight"]
        else:
            weights["not.in.the.model"] = torch.ones(3)
        async with WeightSender(engine.endpoint, config=SMALL) as sender:
            with pytest.raises(RejectedError) as caught:
                await sender.send(weights, version=0)
            assert caught.value.peer == engine.endpoint
        while (event := await engine.event())["event"] != "failed":
            assert event["event"] != "applying", "a byte moved"
        assert event["servable"] is True
        assert event["current"] is None
        zeros = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in mixed_weights().items()}
        assert event["digests"] == digests(zeros)


@only_asyncio
async def test_an_engine_lost_after_preparing_is_reported_and_the_others_commit() -> None:
    with engine_processes([], ["--die-in-commit"]) as (good, doomed):
        async with WeightSender([good.endpoint, doomed.endpoint], config=SMALL) as sender:
            weights = mixed_weights(seed=4)
            report = await sender.send(weights, version=0)  # policy all: the decision was commit
            assert report.committed == [good.endpoint]
            [lost] = report.failed
            assert (lost.engine, lost.status) == (doomed.endpoint, "lost after prepare")
        committed = await good.next_commit()
        assert committed["version"] == 0
        assert committed["digests"] == digests(weights)
        assert doomed.proc.wait(timeout=30) == 3
