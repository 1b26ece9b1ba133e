"""One function decides loop or worker thread by a step's size (aiosync.core.where_to_run)."""

from __future__ import annotations

import pytest

from aiosync.core import where_to_run
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import TensorMeta
from aiosync.core.where_to_run import (
    LOOP_BYTES,
    LOOP_CHECKED,
    LOOP_ENTRIES,
    LOOP_LOOKUPS,
    LOOP_SECONDS,
    on_loop,
    walks_tensors,
)
from aiosync.core.wire import Begin, Bucket, Commit, Complete, Slot


def test_no_work_runs_on_the_loop() -> None:
    assert on_loop()


@pytest.mark.parametrize(
    ("measure", "bound"),
    [
        ("entries", LOOP_ENTRIES),
        ("checked", LOOP_CHECKED),
        ("lookups", LOOP_LOOKUPS),
        ("nbytes", LOOP_BYTES),
    ],
)
def test_each_count_is_on_the_loop_up_to_its_bound_and_not_past_it(
    measure: str, bound: int
) -> None:
    assert on_loop(**{measure: bound})
    assert not on_loop(**{measure: bound + 1})


def test_measured_seconds_up_to_the_bound_are_on_the_loop() -> None:
    assert on_loop(measured_seconds=LOOP_SECONDS)
    assert not on_loop(measured_seconds=LOOP_SECONDS * 1.01)


def test_every_measure_given_must_be_within_its_bound() -> None:
    assert on_loop(entries=LOOP_ENTRIES, checked=LOOP_CHECKED, nbytes=LOOP_BYTES)
    assert not on_loop(entries=1, lookups=LOOP_LOOKUPS + 1)
    assert not on_loop(entries=LOOP_ENTRIES + 1, measured_seconds=0.0)


def test_todays_sizes_decide_as_before() -> None:
    # the bounds each caller had before they moved here (issue 27)
    assert (LOOP_ENTRIES, LOOP_CHECKED, LOOP_LOOKUPS, LOOP_BYTES) == (1024, 256, 64, 64 * 1024)
    assert LOOP_SECONDS == 0.5e-3


def test_the_bounds_are_read_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(where_to_run, "LOOP_ENTRIES", 2)
    assert on_loop(entries=2)
    assert not on_loop(entries=3)


def test_an_engine_s_message_walks_tensors_past_the_checked_bound() -> None:
    metas = [TensorMeta(f"t{i}", "float32", (1,)) for i in range(LOOP_CHECKED + 1)]
    assert not walks_tensors(Begin(1, metas[:LOOP_CHECKED]))
    assert walks_tensors(Begin(1, metas))
    assert not walks_tensors(Begin(1, None))
    slots = [Slot(i, 4 * i, 4) for i in range(LOOP_CHECKED)]
    assert not walks_tensors(Bucket(1, 1, 0, 4 * LOOP_CHECKED, slots=slots))
    spec = TensorSpec("x", "float32", (1,), 0, 4)
    assert walks_tensors(Bucket(1, 1, 0, 4 * LOOP_CHECKED, slots=slots, specs=[spec]))
    assert walks_tensors(Complete(1, 2, 1, 1))  # unless the session finds it light
    assert not walks_tensors(Commit(1, 3))
