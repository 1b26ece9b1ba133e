"""The trainer's base store: off by default, memory checked up front, one copy per version."""

from __future__ import annotations

import pytest
import torch

from aiosync.core.errors import AiosyncError, MismatchError, UsageError
from aiosync.delta import BaseConfig, BaseStore, version_digest
from aiosync.delta import base as base_module


def version(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {
        "embed": torch.randn(64, 32, generator=gen),
        "norm": torch.randn(32, generator=gen).to(torch.bfloat16),
    }


def test_keeping_bases_is_off_by_default() -> None:
    assert BaseConfig().store() is None
    store = BaseConfig(keep="host", versions=2).store()
    assert isinstance(store, BaseStore)
    assert (store.keep_on, store.versions) == ("host", 2)
    with pytest.raises(ValueError, match="keep"):
        BaseConfig(keep="disk").store()  # type: ignore[arg-type]


def test_the_memory_is_stated_and_checked_before_anything_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = BaseStore("device", versions=3)
    tensors = version(0)
    needed = 3 * sum(t.nbytes for t in tensors.values())
    assert store.needed_bytes(tensors) == {torch.device("cpu"): needed}
    monkeypatch.setattr(base_module, "free_bytes", lambda device: needed - 1)
    with pytest.raises(AiosyncError, match=f"needs {needed:,} bytes on cpu"):
        store.reserve(tensors)
    assert store.nbytes == 0
    monkeypatch.setattr(base_module, "free_bytes", lambda device: needed)
    store.reserve(tensors)
    assert store.nbytes == needed


def reserved(versions: int) -> BaseStore:
    store = BaseStore("host", versions=versions)
    store.reserve(version(0))
    return store


def test_a_kept_version_is_a_copy_with_its_digest() -> None:
    store = reserved(1)
    v1 = version(1)
    kept = store.keep(1, v1)
    assert kept.digest == version_digest(v1.values())
    v1["embed"].add_(1.0)  # the trainer steps on
    store.committed("e0", 1)
    base = store.base_for("e0")
    assert base is kept
    assert torch.equal(base.tensors["embed"], version(1)["embed"])
    assert store.keep(1, version(1)) is kept  # kept once


def test_engines_on_one_version_share_its_copy_and_others_keep_theirs() -> None:
    store = reserved(2)
    store.keep(1, version(1))
    for engine in ("a", "b"):
        store.committed(engine, 1)
    store.keep(2, version(2))
    store.committed("a", 2)
    base_a, base_b = store.base_for("a"), store.base_for("b")
    assert base_a is not None
    assert base_b is not None
    assert (base_a.version, base_b.version) == (2, 1)
    assert store.nbytes == 2 * sum(t.nbytes for t in version(0).values())


def test_with_every_slot_held_the_oldest_version_gives_way() -> None:
    store = reserved(2)
    store.keep(1, version(1))
    store.committed("slow", 1)
    store.keep(2, version(2))
    store.committed("fast", 2)
    store.keep(3, version(3))  # both slots held: version 1's goes
    assert store.base_for("slow") is None  # sent the whole version next
    fast = store.base_for("fast")
    assert fast is not None
    assert fast.version == 2
    store.committed("fast", 3)
    newest = store.base_for("fast")
    assert newest is not None
    assert torch.equal(newest.tensors["norm"], version(3)["norm"])


def test_one_slot_is_overwritten_by_the_next_version() -> None:
    store = reserved(1)
    store.keep(1, version(1))
    store.committed("late", 1)
    store.keep(2, version(2))
    assert store.base_for("late") is None
    store.committed("late", 2)
    assert store.base_for("late") is not None
    store.forget("late")
    assert store.base_for("late") is None


def test_a_version_unlike_the_reserved_one_is_refused() -> None:
    with pytest.raises(UsageError, match="reserve"):
        BaseStore("host").keep(1, version(1))
    store = reserved(1)
    with pytest.raises(MismatchError):
        store.keep(1, {"embed": torch.zeros(64, 32)})
    with pytest.raises(MismatchError, match="reserved as"):
        store.keep(1, {"embed": torch.zeros(64, 33), "norm": torch.zeros(32)})
