"""The server's pure bookkeeping: retention by count and bytes with pins, lag and selection."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiosync.core.errors import UsageError
from aiosync.server.fleet import FleetBook
from aiosync.server.retention import RetentionBook, RetentionPolicy
from aiosync.server.store import RetainedBucket, index_version


def test_count_bound_keeps_the_newest_and_skips_pinned() -> None:
    book = RetentionBook(RetentionPolicy(max_versions=2))
    for v in range(3):
        assert book.reserve(10).fits
        book.commit(v)
    assert book.versions == [1, 2]
    assert book.pin(1)
    assert book.reserve(10).fits
    assert book.commit(3) == (2,)  # 1 is pinned: the next oldest goes
    assert book.versions == [1, 3]
    assert book.unpin(1) == ()  # back within the count
    assert not book.pin(2)  # gone


def test_byte_bound_evicts_oldest_unpinned_then_waits_for_pins() -> None:
    book = RetentionBook(RetentionPolicy(max_versions=10, max_bytes=100))
    for v in range(2):
        assert book.reserve(40).fits
        book.commit(v)
    book.pin(0)
    book.pin(1)
    room = book.reserve(40)
    assert room == type(room)((), fits=False)  # every older version in flight: wait
    assert book.pending == 0
    book.unpin(0)
    room = book.reserve(40)
    assert room.evict == (0,)
    assert room.fits
    assert book.used_bytes == 80
    with pytest.raises(UsageError, match="cannot be retained"):
        book.reserve(21)  # pending 40 + 21 beside the newest 40 > 100: never fits
    book.abort()
    assert book.used_bytes == 40


@given(
    st.lists(
        st.tuples(st.sampled_from(["publish", "pin", "unpin"]), st.integers(1, 60)),
        max_size=60,
    ),
    st.integers(1, 4),
)
def test_bounds_hold_under_any_sequence(ops: list[tuple[str, int]], count: int) -> None:
    book = RetentionBook(RetentionPolicy(max_versions=count, max_bytes=150))
    pins: list[int] = []
    version = 0
    for op, n in ops:
        if op == "publish":
            try:
                room = book.reserve(n)
            except UsageError:
                continue
            if room.fits:
                book.commit(version)
                version += 1
            else:
                book.abort()
        elif op == "pin" and book.versions:
            v = book.versions[n % len(book.versions)]
            assert book.pin(v)
            pins.append(v)
        elif op == "unpin" and pins:
            book.unpin(pins.pop(n % len(pins)))
        assert book.used_bytes <= 150
        assert all(v in book.versions for v in pins)  # pinned versions stay
        unpinned = [v for v in book.versions if v not in pins]
        assert len(unpinned) <= count or unpinned == book.versions[-1:]
        if version:
            assert book.newest == version - 1  # the newest is never evicted


def test_lag_counts_published_versions_not_numbers() -> None:
    fleet = FleetBook()
    fleet.add("a", max_lag=1)
    fleet.add("b", max_lag=0)
    assert fleet.all_within_bounds()  # nothing published yet
    for v in (10, 20, 35):
        fleet.publish(v)
    assert fleet.lag("a") == 3
    assert not fleet.within_bound("a")
    fleet.subscribers["a"].version = 20
    fleet.subscribers["b"].version = 35
    assert fleet.lag("a") == 1
    assert fleet.all_within_bounds()
    assert fleet.have(20)
    assert not fleet.have(35)
    assert fleet.have(35, ["b"])
    assert not fleet.have(10, ["gone"])
    with pytest.raises(UsageError):
        fleet.add("a", max_lag=0)


def test_next_version_follows_newest_or_holds_a_fetched_one() -> None:
    fleet = FleetBook()
    state = fleet.add("a", max_lag=0)
    assert fleet.next_version("a", []) is None
    assert fleet.next_version("a", [1, 2, 3]) == 3  # never 1 then 2: the newest, whole
    state.version = 3
    assert fleet.next_version("a", [1, 2, 3]) is None
    state.follow, state.target = False, 1
    assert fleet.next_version("a", [1, 2, 3]) == 1
    state.version = 1
    assert fleet.next_version("a", [1, 2, 3, 4]) is None  # held on the fetched one
    state.version, state.target = 3, 2
    assert fleet.next_version("a", [3, 4]) is None
    assert state.target is None


def test_index_rebuilds_manifest_and_slots_from_specs() -> None:
    from aiosync.core.layout import TensorSpec

    a0 = TensorSpec("a", "float32", (4, 256), 0, 2048, 0)
    b = TensorSpec("b", "int64", (2,), 2048, 16, 0)
    a1 = TensorSpec("a", "float32", (4, 256), 0, 2048, 2048)
    buckets = [RetainedBucket(None, 2064, [a0, b]), RetainedBucket(None, 2048, [a1])]  # type: ignore[arg-type]
    retained = index_version(7, buckets)
    assert [(t.name, t.chunks) for t in retained.manifest] == [("a", 2), ("b", 1)]
    assert retained.tensors == 2
    assert retained.nbytes == 4112
    assert [s.entry for s in buckets[0].slots] == [0, 1]
    assert buckets[1].slots[0].start == 2048


def test_peer_waits_are_clamped() -> None:
    from aiosync.server.messages import bounded_wait

    assert bounded_wait(float("nan"), 10) == 0.0
    assert bounded_wait(float("-inf"), 10) == 0.0
    assert bounded_wait(float("inf"), 10) == 10
    assert bounded_wait(2.5, 10) == 2.5


@given(st.binary(max_size=256))
def test_undecodable_control_bytes_are_a_protocol_error(data: bytes) -> None:
    from aiosync.core.errors import ProtocolError
    from aiosync.server import messages as m

    with contextlib.suppress(ProtocolError):
        m.decode_request(data)
    with pytest.raises(ProtocolError):
        m.decode_request(b"\x00" * (m.MAX_CONTROL_BYTES + 1))
