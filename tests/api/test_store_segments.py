"""The store's segments filled in place (issue 29, item 1): reserved, placed, kept on abort.

A relay receives each bucket straight into the segment the store retains: it reserves one
(counted against the retention bytes, a retired version's reused), fills it and places it;
an abort hands back the segments the caller keeps for its next attempt, and a kept one is
reserved again as it is. Once a relay has pulled, every bucket is hashed as it arrives.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from aiosync.core.errors import UsageError
from aiosync.core.layout import TensorSpec
from aiosync.server import RetentionPolicy
from aiosync.server.store import RetentionStore


def spec(nbytes: int) -> list[TensorSpec]:
    return [TensorSpec("w", "uint8", (nbytes,), 0, nbytes)]


def fill(store: RetentionStore, value: int, nbytes: int = 4096) -> None:
    segment = store.reserve_segment(nbytes)
    segment.tensor.fill_(value)
    store.add_segment(segment, nbytes, spec(nbytes))


def test_reserved_segments_are_counted_placed_in_order_and_retained_without_a_copy() -> None:
    store = RetentionStore(RetentionPolicy(max_versions=2))
    try:
        first = store.reserve_segment(4096)
        second = store.reserve_segment(8192)
        assert store.used_bytes == 4096 + 8192  # reserved: counted before it is filled
        second.tensor.fill_(2)
        first.tensor.fill_(1)
        store.add_segment(first, 4096, spec(4096))
        store.add_segment(second, 8192, spec(8192), digest=b"d" * 32)
        retained = store.commit(0)
        assert [bucket.segment for bucket in retained.buckets] == [first, second]
        assert retained.buckets[1].digest == b"d" * 32  # the caller's, checked by it
        assert int(retained.buckets[0].segment.tensor[0]) == 1
    finally:
        store.close()


def test_a_commit_releases_reserved_segments_never_placed() -> None:
    store = RetentionStore(RetentionPolicy(max_versions=2))
    try:
        fill(store, 1)
        store.reserve_segment(8192)  # never placed
        retained = store.commit(0)
        assert retained.nbytes == 4096
        assert store.used_bytes == 4096
    finally:
        store.close()


def test_an_abort_recycles_all_but_the_segments_kept_which_come_back_as_they_are() -> None:
    store = RetentionStore(RetentionPolicy(max_versions=1))
    try:
        fill(store, 9)
        store.commit(0)
        kept = store.reserve_segment(4096)
        kept.tensor.fill_(7)
        store.add_segment(kept, 4096, spec(4096))
        other = store.reserve_segment(4096)
        store.abort(keep=[kept])
        assert store.used_bytes == 4096  # only version 0
        assert int(kept.tensor[0]) == 7  # still the caller's, untouched
        again = store.reserve_segment(4096, segment=kept)  # reserved again, as it is
        assert again is kept
        assert store.reserve_segment(4096) is other  # the one not kept was kept for reuse
        with pytest.raises(UsageError, match="cannot hold"):
            store.reserve_segment(100, segment=kept)
    finally:
        store.close()


def test_once_asked_to_hash_ahead_every_bucket_is_hashed_as_it_arrives() -> None:
    store = RetentionStore(RetentionPolicy(max_versions=2))
    try:
        fill(store, 1)
        before = store.commit(0)
        assert before.buckets[0].hashing is None  # no relay yet: nothing hashed
        store.hash_ahead()
        fill(store, 2)
        store.add_bucket(torch.full((4096,), 3, dtype=torch.uint8), spec(4096))
        after = store.commit(1)
        assert all(bucket.hashing is not None for bucket in after.buckets)
        expected = [hashlib.sha256(bytes([v]) * 4096).digest() for v in (2, 3)]
        assert after.digests() == expected
        assert before.digests() == [hashlib.sha256(bytes([1]) * 4096).digest()]  # on demand
    finally:
        store.close()
