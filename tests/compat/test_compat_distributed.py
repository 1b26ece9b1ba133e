"""NeMo-RL's broadcast path on aiosync, across processes with Gloo (issue 11, item 4/6/7/9).

A trainer (this process, rank 0) and engine processes (``tests.helpers.handle_engine``: an
AiosyncEngine with staged module sinks behind the control channel) run the compat
functions end to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from aiosync.compat import distributed
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.compat.nemo_rl import iter_named_tensor_buckets
from aiosync.handles import ChannelHandle
from aiosync.runtime import child_env, stop_process
from tests.helpers.handle_peers import ROOT, engine_process, engine_processes
from tests.helpers.models import digest, mixed_weights

BUCKET = 128 * 1024


@pytest.fixture(autouse=True)
def _gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "30")


def _handles(*engines: object) -> list[ChannelHandle]:
    return [ChannelHandle.connect(e.endpoint, name=f"e{i}") for i, e in enumerate(engines)]  # type: ignore[attr-defined]


def _close(handles: list[ChannelHandle]) -> None:
    for handle in handles:
        distributed._loop().call(handle.aclose)


def _digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest(tensor) for name, tensor in weights.items()}


def _send(
    handles: list[ChannelHandle], group: object, name: str, seed: int, version: int
) -> dict[str, str]:
    weights = mixed_weights(seed)
    broadcast_hf_buckets_via_distributed_impl(
        bucket_iterator=iter_named_tensor_buckets(weights.items(), BUCKET),
        rollout_engines=handles,
        rollout_engine_lock=threading.Lock(),
        group_name=name,
        model_update_group=group,  # type: ignore[arg-type]
        weight_version=version,
    )
    return _digests(weights)


def test_two_engines_one_of_two_ranks_bit_exact_then_disconnect_twice_and_reconnect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with engine_processes(("--ranks", "1"), ("--ranks", "2")) as (one, two):
        handles = _handles(one, two)
        ranks = [(one, 0), (two, 0), (two, 1)]
        try:
            group = connect_rollout_engines_from_distributed(
                group_name="e2e", rollout_engines=handles, engine_gpu_counts=[1, 2]
            )
            assert group.size() == 4
            assert group.rank() == 0
            expected = _send(handles, group, "e2e", seed=1, version=1)
            for engine, rank in ranks:
                event = engine.wait_for("committed", rank=rank)
                assert event["version"] == 1
                assert event["digests"] == expected
            monkeypatch.setenv(distributed.FORMAT_ENV, "flattened")  # one broadcast per bucket
            expected = _send(handles, group, "e2e", seed=2, version=2)
            for engine, rank in ranks:
                event = engine.wait_for("committed", rank=rank, version=2)
                assert event["digests"] == expected
            for _ in range(2):  # idempotent
                disconnect_rollout_engines_from_distributed(
                    group_name="e2e", model_update_group=group, rollout_engines=handles
                )
            with pytest.raises(ValueError, match="not connected"):
                _send(handles, group, "e2e", seed=3, version=3)
            group = connect_rollout_engines_from_distributed(
                group_name="e2e", rollout_engines=handles, engine_gpu_counts=[1, 2]
            )
            expected = _send(handles, group, "e2e", seed=3, version=3)
            for engine, rank in ranks:
                assert engine.wait_for("committed", rank=rank, version=3)["digests"] == expected
            disconnect_rollout_engines_from_distributed(
                group_name="e2e", model_update_group=group, rollout_engines=handles
            )
        finally:
            _close(handles)


def test_engine_killed_mid_broadcast_ends_within_deadline_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "20")
    with engine_processes(("--ranks", "1"), ("--hang-in-apply",)) as (good, bad):
        handles = _handles(good, bad)
        try:
            group = connect_rollout_engines_from_distributed(
                group_name="kill", rollout_engines=handles, engine_gpu_counts=[1, 1]
            )
            errors: list[BaseException] = []
            done = threading.Event()

            def sync() -> None:
                try:
                    _send(handles, group, "kill", seed=1, version=1)
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    done.set()

            worker = threading.Thread(target=sync)
            worker.start()
            bad.wait_for("applying")  # it received the first bucket and is stuck in it
            os.kill(bad.proc.pid, signal.SIGKILL)
            assert done.wait(60), "the sync did not end"
            worker.join()
            assert len(errors) == 1
            error = errors[0]
            assert isinstance(error, RuntimeError | TimeoutError)
            assert "e1" in str(error)
            # the surviving engine never committed: it keeps its previous version (none)
            assert all(e["event"] != "committed" for e in good.drain())
            started = time.monotonic()
            disconnect_rollout_engines_from_distributed(
                group_name="kill", model_update_group=group, rollout_engines=handles
            )
            assert time.monotonic() - started < 20 * 5  # a hang guard, with a 5x margin
            health = distributed._loop().call(handles[0].check_health)
            assert health.healthy
            assert health.weight_version is None
        finally:
            _close(handles)


def test_engine_frozen_mid_broadcast_times_out_naming_it_and_disconnect_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deadline = 4.0
    with engine_processes(("--ranks", "1"), ("--hang-in-apply",)) as (good, frozen):
        handles = _handles(good, frozen)
        try:
            group = connect_rollout_engines_from_distributed(
                group_name="frozen", rollout_engines=handles, engine_gpu_counts=[1, 1]
            )
            monkeypatch.setenv(distributed.TIMEOUT_ENV, str(deadline))  # for the sync only
            errors: list[BaseException] = []
            done = threading.Event()

            def sync() -> None:
                try:
                    _send(handles, group, "frozen", seed=1, version=1)
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    done.set()

            worker = threading.Thread(target=sync)
            worker.start()
            frozen.wait_for("applying")
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            try:
                assert done.wait(deadline * 5), "the sync outlived its deadline"
                worker.join()
                assert len(errors) == 1
                assert isinstance(errors[0], TimeoutError)
                assert "e1" in str(errors[0])
                assert "e0" not in str(errors[0])  # it answered
                assert all(e["event"] != "committed" for e in good.drain())
                disconnect_rollout_engines_from_distributed(
                    group_name="frozen", model_update_group=group, rollout_engines=handles
                )
                health = distributed._loop().call(handles[0].check_health)
                assert health.healthy
                assert health.weight_version is None
            finally:
                os.kill(frozen.proc.pid, signal.SIGKILL)  # stuck for good: no graceful exit
        finally:
            _close(handles)


def test_trainer_killed_mid_broadcast_leaves_the_engine_on_its_previous_version() -> None:
    timeout = 5.0
    with engine_process("--ranks", "1", "--timeout", str(timeout)) as engine:
        env = child_env()
        env.update(GLOO_SOCKET_IFNAME="lo", AIOSYNC_COLLECTIVE_BACKEND="gloo")
        trainer = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.handle_trainer", engine.endpoint],
            stdout=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
        )
        try:
            v1 = engine.wait_for("committed", version=1)
            assert v1["digests"] == _digests(mixed_weights(1))
            assert engine.wait_for("answered", success=True)
            # version 2: the trainer dies before broadcasting; the receive ends by the timeout
            while True:
                answer = engine.wait_for("answered")
                if not answer["success"]:
                    break
            assert "receiving a bucket" in answer["message"]
            assert trainer.wait(timeout * 5) == 0
            assert all(e["event"] != "committed" for e in engine.drain())
            handle = ChannelHandle.connect(engine.endpoint, name="engine")
            try:
                health = distributed._loop().call(handle.check_health)
            finally:
                distributed._loop().call(handle.aclose)
            assert health.weight_version == "1"
        finally:
            stop_process(trainer, grace=5)
