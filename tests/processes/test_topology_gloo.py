"""Colocated topologies across 4 trainer processes (Gloo on the CPU, memfds for CUDA IPC).

The four ranks start once for the module (tests/helpers/colocate_worker.py); each test sends them
one scenario and reads one answer per rank. Engines live in their source rank's process.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiosync.runtime import child_env, stop_process

WORLD = 4
GUARD = 90  # seconds: a hang guard only, never a measured bound
GROUP_TIMEOUT = 120  # the groups' timeout (AIOSYNC_TIMEOUT's default)


class World:
    """Four worker processes and a reader thread per stdout."""

    def __init__(self, store: Path) -> None:
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.helpers.colocate_worker",
                    str(r),
                    str(WORLD),
                    str(store),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=child_env(),
            )
            for r in range(WORLD)
        ]
        self.lines: list[queue.Queue[str]] = [queue.Queue() for _ in range(WORLD)]
        for proc, lines in zip(self.procs, self.lines, strict=True):
            threading.Thread(target=self._pump, args=(proc, lines), daemon=True).start()

    @staticmethod
    def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    def read(self, rank: int) -> dict[str, Any]:
        try:
            line = self.lines[rank].get(timeout=GUARD)
        except queue.Empty:
            pytest.fail(f"rank {rank} gave no answer within {GUARD}s (hung?)")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, **cmd: Any) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        answers = [self.read(rank) for rank in range(WORLD)]
        for answer in answers:
            assert "fatal" not in answer, answer
        return answers

    def close(self) -> None:
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.close()
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            stop_process(proc, grace=10)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    store = tmp_path_factory.mktemp("gloo") / "store"
    started = World(store)
    try:
        for rank in range(WORLD):
            assert started.read(rank) == {"ready": rank}
        yield started
    finally:
        started.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "one-bucket-at-a-time"])
def test_dense_two_by_two_is_bit_exact_and_engines_number_versions(
    world: World, overlap: bool
) -> None:
    answers = world.run(counts=[2, 2], versions=[None, None], overlap=overlap)
    assert [a["engine"] for a in answers] == [0, 0, 1, 1]
    assert [a["src"] for a in answers] == [0, 0, 2, 2]
    for answer in answers:
        assert answer["reports"] == [{"buckets": 3, "source": answer["rank"] in (0, 2)}] * 2
    for source in (answers[0], answers[2]):  # weight_version=None: the engine's next, twice
        assert source["exact"] is True
        assert source["engine_version"] == 1
    assert "exact" not in answers[1]
    assert "exact" not in answers[3]


def test_one_then_three_with_a_given_version(world: World) -> None:
    answers = world.run(counts=[1, 3], versions=[7], per_bucket=1)
    assert [a["engine"] for a in answers] == [0, 1, 1, 1]
    assert [a["src"] for a in answers] == [0, 1, 1, 1]
    for source in answers[:2]:
        assert source["exact"] is True
        assert source["engine_version"] == 7  # passed on as given
    assert all(a["reports"] == [{"buckets": 6, "source": a["rank"] < 2}] for a in answers)


def test_one_engine_over_all_four_ranks(world: World) -> None:
    answers = world.run(counts=[4], versions=[3], per_bucket=4)
    assert [a["engine"] for a in answers] == [0] * 4
    assert [a["src"] for a in answers] == [0] * 4
    assert answers[0]["exact"] is True
    assert answers[0]["engine_version"] == 3


def test_explicit_offsets_leave_a_placeholder_that_returns_at_once(world: World) -> None:
    answers = world.run(counts=[1, 2], offsets=[0, 2], versions=[None])
    placeholder = answers[1]
    assert placeholder["engine"] is None
    assert placeholder["src"] is None
    assert placeholder["group"] is None
    assert placeholder["reports"] == [{"buckets": 0, "source": False}]
    assert [a["engine"] for a in answers] == [0, None, 1, 1]
    assert answers[0]["exact"] is True
    assert answers[2]["exact"] is True
    assert answers[0]["engine_version"] == 0 == answers[2]["engine_version"]


def test_same_layout_is_a_no_op_and_a_change_rebuilds_every_group(world: World) -> None:
    first = world.run(counts=[2, 2])
    again = world.run(counts=[2, 2])
    assert [a["group"] for a in again] == [a["group"] for a in first]
    assert [a["live_groups"] for a in again] == [a["live_groups"] for a in first]
    changed = world.run(counts=[3, 1])
    assert [a["layout_key"] for a in changed] == [[WORLD, [[0, 3], [3, 1]]]] * WORLD
    for old, new in zip(first, changed, strict=True):
        assert new["group"] != old["group"]
        # the old groups were destroyed: as many live groups as before, not more
        assert new["live_groups"] == old["live_groups"]
    assert [a["src"] for a in changed] == [0, 0, 0, 3]
    back = world.run(counts=[2, 2], versions=[None])
    assert back[0]["exact"] is True
    assert back[2]["exact"] is True


@pytest.mark.parametrize(
    ("fail", "text"),
    [
        ({"engine": 1, "mode": "result", "at": 1}, "out of memory on purpose"),
        ({"engine": 0, "mode": "raise", "at": 0}, "engine crashed on purpose"),
    ],
    ids=["failed-result", "raised"],
)
def test_a_failing_engine_is_named_on_every_rank_and_the_next_sync_recovers(
    world: World, fail: dict[str, Any], text: str
) -> None:
    answers = world.run(counts=[2, 2], versions=[4, 5], fail=fail)
    bad = fail["engine"]
    for answer in answers:
        failed, recovered = answer["reports"]
        assert "RejectedError" in failed["types"]
        assert "AiosyncError" in failed["types"]
        assert f"engine {bad}" in failed["error"]
        assert f"bucket {fail['at']}" in failed["error"]
        assert recovered == {"buckets": 3, "source": answer["rank"] in (0, 2)}
    source = answers[2 * bad]
    assert text in source["reports"][0]["error"]  # the engine's own text, on its source
    assert f"sglang-{bad}" in source["reports"][0]["error"]
    for src in (answers[0], answers[2]):  # both engines, the failed one too, took version 5
        assert src["exact"] is True
        assert src["engine_version"] == 5


def test_an_engine_failing_to_prepare_leaves_every_engine_on_its_version(world: World) -> None:
    # 3 buckets, prepare, commit per sync: call 8 is engine 1's prepare of the second sync
    fail = {"engine": 1, "mode": "result", "at": 8, "staged": True}
    answers = world.run(counts=[2, 2], versions=[1, 2], fail=fail)
    for answer in answers:
        ok, failed = answer["reports"]
        assert ok["buckets"] == 3
        assert "engine 1" in failed["error"]
        assert "failed the version's prepare" in failed["error"]
    for source in (answers[0], answers[2]):  # engine 0 prepared version 2 but did not commit
        assert source["engine_version"] == 1
        assert source["exact"] is True  # staged: still version 1, bit for bit


def test_a_rank_whose_buckets_raise_fails_the_bucket_on_every_rank(world: World) -> None:
    answers = world.run(counts=[2, 2], versions=[1, 2], broken={"rank": 3, "at": 1})
    for answer in answers:
        failed, recovered = answer["reports"]
        assert "engine 1" in failed["error"]
        assert "bucket 1" in failed["error"]
        assert recovered["buckets"] == 3
    assert (
        "trainer rank 3: reading the next bucket raised TypeError"
        in answers[2]["reports"][0]["error"]
    )
    for source in (answers[0], answers[2]):
        assert source["exact"] is True
        assert source["engine_version"] == 2


def test_a_silent_engine_fails_its_bucket_and_releases_every_rank(world: World) -> None:
    budget = 2.0  # the engine call's share of it: 1.5 s
    answers = world.run(
        counts=[2, 2], versions=[1, 2], timeout=budget, fail={"engine": 1, "mode": "hang", "at": 2}
    )
    for answer in answers:
        failed, recovered = answer["reports"]
        assert "engine 1" in failed["error"]
        assert "bucket 2" in failed["error"]
        # released by the failure, not by the groups' timeout (a 5x margin and more)
        assert failed["seconds"] < GROUP_TIMEOUT / 5
        assert recovered["buckets"] == 3
    assert "no answer within" in answers[2]["reports"][0]["error"]
    assert answers[2]["exact"] is True
    assert answers[2]["engine_version"] == 2


@pytest.mark.skipif(os.environ.get("AIOSYNC_TIMEOUT") is not None, reason="timeout overridden")
def test_group_timeout_default_is_what_the_margin_test_assumes() -> None:
    from aiosync.topology.connect import default_timeout

    assert default_timeout() == GROUP_TIMEOUT


def test_nemo_rl_names_sync_and_raise_runtime_errors(world: World) -> None:
    answers = world.run(
        compat=True, counts=[1, 3], versions=[2, 3], fail={"engine": 1, "mode": "result", "at": 0}
    )
    for answer in answers:
        failed, recovered = answer["reports"]
        assert "RuntimeError" in failed["types"]
        assert "AiosyncError" in failed["types"]
        assert "send_hf_buckets_via_ipc_actor_impl" in failed["error"]
        assert "engine 1" in failed["error"]
        assert recovered == {"compat": True}
    assert answers[0]["layout_key"] == [WORLD, [[0, 1], [1, 3]]]
    for source in answers[:2]:
        assert source["exact"] is True
        assert source["engine_version"] == 3


def test_raw_ray_actor_handles_as_nemo_rl_passes_them(world: World) -> None:
    pytest.importorskip("ray")
    answers = world.run(counts=[4], versions=[None, 8], ray=True)
    for answer in answers:
        assert answer["reports"] == [{"buckets": 3, "source": answer["rank"] == 0}] * 2
    assert answers[0]["exact"] is True  # a Ray actor read the four ranks' memfds
    assert answers[0]["engine_version"] == 8
