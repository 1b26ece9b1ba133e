"""A relay's windowed, zero-copy fetch (issue 29, items 1 and 4): bounded, and strict.

The fetch is driven here through an in-memory channel whose every chunk the test writes,
so what the relay asks for, and what it does with each bad chunk, is seen exactly: at most
a window of chunks asked for at once; each chunk copied once into the segment the store
retains; every bad chunk (truncated, oversize, past its bucket, of another bucket, in the
wrong number of parts) and every bucket that does not match its digest refused with an
error naming the version, the bucket and the offset. A frame past ``max_message_bytes``
is refused by libzmq itself, over a real socket.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import pytest

import aiosync.server.messages as m
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.zmq import ZmqChannel, ZmqListener
from aiosync.core.errors import PeerGoneError, ProtocolError, RejectedError
from aiosync.core.layout import TensorSpec
from aiosync.server import RetentionPolicy
from aiosync.server.relay_fetch import BucketFill, Window, chunks_of, fetch
from aiosync.server.store import RetentionStore

KiB = 1 << 10
WAIT = 30.0


@dataclass
class Done:
    """A delivery that is always done (the in-memory channel copies nothing)."""

    done: bool = True


@dataclass
class ScriptedChannel:
    """A relay's channel to an upstream that the test plays: gets recorded, chunks fed."""

    gets: list[m.Get] = field(default_factory=list)
    inbox: list[list[bytes]] = field(default_factory=list)
    arrived: anyio.Event = field(default_factory=anyio.Event)

    peer: str = "upstream"
    key: bytes | None = None
    window: int | None = None
    lost: anyio.Event = field(default_factory=anyio.Event)

    async def send(self, payload: bytes) -> None:
        request = m.decode_request(payload)
        assert isinstance(request, m.Get)
        self.gets.append(request)

    async def send_parts(self, parts: Sequence[bytes | memoryview]) -> Done:
        raise AssertionError("a relay sends no parts")

    async def recv(self) -> bytes:
        raise AssertionError("a relay's fetch reads parts")

    async def recv_parts(self) -> list[memoryview]:
        while not self.inbox:
            self.arrived = anyio.Event()
            await self.arrived.wait()
        return [memoryview(part) for part in self.inbox.pop(0)]

    def feed(self, *parts: bytes) -> None:
        self.inbox.append(list(parts))
        self.arrived.set()

    def answer(self, get: m.Get, data: bytes) -> None:
        """The chunk an honest upstream sends for ``get`` out of ``data``."""
        piece = data[get.offset : get.offset + get.nbytes]
        self.feed(m.encode(m.Chunk(get.version, get.bucket, get.offset, len(piece))), piece)

    async def aclose(self) -> None:
        return None


def head_of(data: bytes) -> m.BucketHead:
    spec = TensorSpec("w", "uint8", (len(data),), 0, len(data))
    return m.BucketHead(len(data), hashlib.sha256(data).digest(), [spec])


@pytest.fixture
def store() -> RetentionStore:
    return RetentionStore(RetentionPolicy(max_versions=2))


def fills_of(store: RetentionStore, *buckets: bytes) -> list[BucketFill]:
    return [BucketFill(i, head_of(data), store.reserve_segment) for i, data in enumerate(buckets)]


SMALL = Window(chunk=4 * KiB, chunks=3, lanes=2, timeout=WAIT, max_frame=64 * KiB)


def test_chunks_cover_each_bucket_in_order() -> None:
    heads = [head_of(bytes(n)) for n in (10, 4, 9)]
    fills = [BucketFill(i, head, RetentionStore.reserve_segment) for i, head in enumerate(heads)]
    asked = [(fill.index, offset, n) for fill, offset, n in chunks_of(fills, 4)]
    assert asked == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 4), (2, 0, 4), (2, 4, 4), (2, 8, 1)]


async def test_at_most_a_window_of_chunks_is_asked_for_and_each_lands_in_its_segment(
    store: RetentionStore,
) -> None:
    buckets = [bytes([i]) * (10 * KiB) + bytes(range(256)) for i in range(1, 4)]
    fills = fills_of(store, *buckets)
    channel = ScriptedChannel()
    seen: list[int] = []
    async with anyio.create_task_group() as tg:
        result: list[int] = []

        async def run() -> None:
            whole = lambda fill: seen.append(fill.index)  # noqa: E731
            result.append(await fetch(channel, 5, fills, SMALL, whole=whole, upstream="u"))

        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert len(channel.gets) == SMALL.chunks  # the window, asked for at once
        answered = 0
        while not result:
            with anyio.fail_after(WAIT):
                while len(channel.gets) == answered and not result:
                    await anyio.sleep(0.001)
            if result:
                break
            # never more than the window asked for and not yet answered and placed
            assert len(channel.gets) - answered <= SMALL.chunks
            get = channel.gets[answered]
            channel.answer(get, buckets[get.bucket])
            answered += 1
    total = sum(len(data) for data in buckets)
    assert result == [total]
    assert sum(get.nbytes for get in channel.gets) == total  # each byte asked for once
    assert all(get.version == 5 and get.nbytes <= SMALL.chunk for get in channel.gets)
    assert sorted(seen) == [0, 1, 2]  # every bucket whole and matching its digest
    for fill, data in zip(fills, buckets, strict=True):
        assert fill.segment is not None
        assert bytes(fill.segment.tensor.numpy().data) == data  # the store's own segment
    store.abort()
    store.close()


async def bad(store: RetentionStore, *parts: bytes, data: bytes | None = None) -> Exception:
    """What the fetch of one 8 KiB bucket of version 7 raises when ``parts`` answer it.

    With ``data``, the first chunk is answered honestly from it and ``parts`` answer the
    second.
    """
    bucket = bytes(range(256)) * 32
    fills = fills_of(store, bucket)
    channel = ScriptedChannel()
    window = Window(chunk=4 * KiB, chunks=2, lanes=1, timeout=WAIT, max_frame=64 * KiB)
    if data is not None:
        channel.answer(m.Get(7, 0, 0, 4 * KiB), data)
    channel.feed(*parts)
    with pytest.raises((ProtocolError, RejectedError)) as raised:
        await fetch(channel, 7, fills, window, whole=lambda fill: None, upstream="u")
    store.abort()
    store.close()
    assert "version 7" in str(raised.value)
    return raised.value


def chunk(bucket: int, offset: int, nbytes: int, version: int = 7) -> bytes:
    return m.encode(m.Chunk(version, bucket, offset, nbytes))


async def test_a_truncated_chunk_is_refused_naming_its_bucket(store: RetentionStore) -> None:
    error = await bad(store, chunk(0, 0, 4 * KiB), bytes(4 * KiB - 1))
    assert "bucket 0 at byte 0: asked for 4096 bytes, the chunk says 4096 and carries 4095" in str(
        error
    )


async def test_an_oversize_chunk_is_refused(store: RetentionStore) -> None:
    error = await bad(store, chunk(0, 0, 4 * KiB + 1), bytes(4 * KiB + 1))
    assert "asked for 4096 bytes, the chunk says 4097 and carries 4097" in str(error)


async def test_a_chunk_past_its_bucket_or_of_another_is_refused(store: RetentionStore) -> None:
    past = await bad(store, chunk(0, 8 * KiB, 4 * KiB), bytes(4 * KiB))
    assert "expected bucket 0 at byte 0, got bucket 0 at byte 8192 of version 7" in str(past)
    other = await bad(store, chunk(3, 0, 4 * KiB), bytes(4 * KiB))
    assert "expected bucket 0 at byte 0, got bucket 3 at byte 0" in str(other)
    older = await bad(store, chunk(0, 0, 4 * KiB, version=6), bytes(4 * KiB))
    assert "got bucket 0 at byte 0 of version 6" in str(older)


async def test_a_chunk_without_its_bytes_or_with_more_parts_is_refused(
    store: RetentionStore,
) -> None:
    alone = await bad(store, chunk(0, 0, 4 * KiB))
    assert "bucket 0 at byte 0: asked for 4096 bytes, the chunk says 4096 and carries 1 parts" in (
        str(alone)
    )
    extra = await bad(store, chunk(0, 0, 4 * KiB), bytes(4 * KiB), b"more")
    assert "carries 3 parts" in str(extra)
    head = await bad(store, m.encode(m.Head(7, [])))
    assert "expected bucket 0 at byte 0, got Head" in str(head)


async def test_a_refusal_mid_bucket_ends_the_fetch(store: RetentionStore) -> None:
    data = bytes(range(256)) * 32
    error = await bad(store, m.encode(m.Refused("version 7 is no longer retained")), data=data)
    assert isinstance(error, RejectedError)
    assert "no longer retained" in str(error)


async def test_bytes_that_do_not_match_the_digest_are_refused(store: RetentionStore) -> None:
    data = bytes(range(256)) * 32
    error = await bad(store, chunk(0, 4 * KiB, 4 * KiB), bytes(4 * KiB), data=data)
    assert "bucket 0 does not match its digest" in str(error)


async def test_a_frame_past_max_message_bytes_is_dropped_by_libzmq_with_the_connection() -> None:
    """No oversized frame is buffered: the relay's socket drops the connection, and the
    fetch says which bucket it was waiting for and why that happens."""
    loopback = ChannelAuth(insecure_loopback=True)
    listener = ZmqListener("tcp://127.0.0.1:0", auth=loopback)
    channel = ZmqChannel.connect(listener.endpoint, auth=loopback, max_message_bytes=16 * KiB)
    store = RetentionStore(RetentionPolicy(max_versions=2))
    bucket = bytes(64 * KiB)
    fills = fills_of(store, bucket)
    window = Window(chunk=64 * KiB, chunks=1, lanes=1, timeout=WAIT, max_frame=16 * KiB)
    try:
        async with anyio.create_task_group() as tg:

            async def upstream() -> None:
                peer = await listener.accept()
                get = m.decode_request(await peer.recv())
                assert isinstance(get, m.Get)
                await peer.send_parts([chunk(0, 0, get.nbytes), bucket])
                while True:
                    await listener.accept()

            tg.start_soon(upstream)
            with pytest.raises(PeerGoneError) as gone:
                await fetch(channel, 7, fills, window, whole=lambda fill: None, upstream="u")
            tg.cancel_scope.cancel()
        assert "went while bucket 0 at byte 0 was awaited" in str(gone.value)
        assert "a frame over max_message_bytes, 16384 bytes" in str(gone.value)
        assert "version 7" in str(gone.value)
    finally:
        await channel.aclose()
        await listener.aclose()
        store.abort()
        store.close()
