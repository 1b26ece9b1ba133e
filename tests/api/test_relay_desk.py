"""The upstream's side of a relay's pull (issue 29, items 1 and 4): chunks of a range, sent
as a second message part straight from the retained segment; bad ranges refused naming
the bucket and version; a version pinned only while a chunk is queued; a relay that does
not read held back, within the timeout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import pytest

import aiosync.server.messages as m
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.zmq import ZmqChannel, ZmqListener
from aiosync.core.errors import SyncTimeoutError
from aiosync.core.layout import TensorSpec
from aiosync.server import RetentionPolicy
from aiosync.server.relay_desk import QUEUED_CHUNKS, RelayDesk
from aiosync.server.store import RetentionStore

WAIT = 30.0


@dataclass
class Delivery:
    done: bool = True


@dataclass
class Recording:
    """The relay's end as the desk sees it: every message of parts it was sent."""

    sent: list[list[bytes]] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    written: bool = True  # whether the transport is done with what it was given
    peer: str = "relay"
    key: bytes | None = None
    window: int | None = None
    lost: anyio.Event = field(default_factory=anyio.Event)

    async def send(self, payload: bytes) -> None:
        self.sent.append([payload])

    async def send_parts(self, parts: Sequence[bytes | memoryview]) -> Delivery:
        self.sent.append([bytes(part) for part in parts])
        self.deliveries.append(Delivery(self.written))
        return self.deliveries[-1]

    async def recv(self) -> bytes:
        raise AssertionError("not read here")

    async def recv_parts(self) -> list[memoryview]:
        raise AssertionError("not read here")

    async def aclose(self) -> None:
        return None


def retained_store(data: bytes) -> RetentionStore:
    store = RetentionStore(RetentionPolicy(max_versions=2))
    segment = store.reserve_segment(len(data))
    segment.tensor.numpy()[:] = memoryview(data)
    store.add_segment(segment, len(data), [TensorSpec("w", "uint8", (len(data),), 0, len(data))])
    store.commit(3)
    return store


async def pulled(store: RetentionStore, relay: Recording) -> RelayDesk:
    desk = RelayDesk(store, anyio.Event)
    head = await desk.pull(relay, m.Pull(None, 1.0), 1.0)
    assert isinstance(head, m.Head)
    assert head.version == 3
    return desk


async def test_a_get_is_answered_by_one_chunk_of_exactly_its_range() -> None:
    data = bytes(range(256)) * 64
    store, relay = retained_store(data), Recording()
    try:
        desk = await pulled(store, relay)
        assert await desk.get(relay, m.Get(3, 0, 1000, 3000), WAIT) is None
        header, body = relay.sent[-1]
        assert m.decode_reply(header) == m.Chunk(3, 0, 1000, 3000)
        assert body == data[1000:4000]
        assert desk.bytes_sent == 3000
        assert not store.book.pinned(3)  # pinned only while the chunk was queued
    finally:
        store.close()


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(-1, 10), (0, 0), (16000, 385), (0, m.MAX_CHUNK_BYTES + 1), (2**62, 2**62)],
)
async def test_a_range_outside_the_bucket_is_refused_naming_it(offset: int, nbytes: int) -> None:
    store, relay = retained_store(bytes(16384)), Recording()
    try:
        desk = await pulled(store, relay)
        refusal = await desk.get(relay, m.Get(3, 0, offset, nbytes), WAIT)
        assert isinstance(refusal, m.Refused)
        assert f"bytes [{offset}, {offset + nbytes}) of bucket 0 of version 3" in refusal.reason
        assert relay.sent == []
        assert desk.bytes_sent == 0
        other = await desk.get(relay, m.Get(3, 1, 0, 1), WAIT)
        assert isinstance(other, m.Refused)
        assert "no bucket 1 in version 3" in other.reason
        assert isinstance(await desk.get(relay, m.Get(2, 0, 0, 1), WAIT), m.Refused)
        assert not store.book.pinned(3)
    finally:
        store.close()


async def test_a_relay_that_does_not_read_is_held_back_within_the_timeout() -> None:
    store, relay = retained_store(bytes(16384)), Recording(written=False)
    try:
        desk = await pulled(store, relay)
        for _ in range(QUEUED_CHUNKS + 1):  # queued and not written out: still answered
            assert await desk.get(relay, m.Get(3, 0, 0, 16), WAIT) is None
        with pytest.raises(SyncTimeoutError, match="the relay to read its chunks"):
            await desk.get(relay, m.Get(3, 0, 0, 16), 0.05)
        for delivery in relay.deliveries[:2]:  # the oldest two written out: room again
            delivery.done = True
        assert await desk.get(relay, m.Get(3, 0, 0, 16), WAIT) is None
        assert not store.book.pinned(3)
        desk.release(relay.peer)
        assert relay.peer not in desk.queued
    finally:
        store.close()


async def test_parts_cross_a_zmq_channel_uncopied_and_the_send_is_tracked() -> None:
    loopback = ChannelAuth(insecure_loopback=True)
    listener = ZmqListener("tcp://127.0.0.1:0", auth=loopback)
    channel = ZmqChannel.connect(listener.endpoint, auth=loopback)
    try:
        await channel.send(b"hello")
        with anyio.fail_after(WAIT):
            peer = await listener.accept()
        assert await peer.recv() == b"hello"
        body = bytearray(range(256)) * 4096  # 1 MiB, sent from this buffer itself
        delivery = await peer.send_parts([b"header", memoryview(body)])
        with anyio.fail_after(WAIT):
            parts = await channel.recv_parts()
        assert [bytes(part) for part in parts] == [b"header", bytes(body)]
        with anyio.fail_after(WAIT):
            while not delivery.done:  # written out: the buffer is the caller's again
                await anyio.sleep(0.001)
    finally:
        await channel.aclose()
        await listener.aclose()


async def test_a_dealer_sends_parts_uncopied_too() -> None:
    import zmq
    import zmq.asyncio

    with zmq.asyncio.Context() as ctx, ctx.socket(zmq.ROUTER) as router:
        router.bind("tcp://127.0.0.1:0")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        channel = ZmqChannel.connect(endpoint, auth=ChannelAuth(insecure_loopback=True))
        try:
            body = bytearray(b"x" * 100_000)
            delivery = await channel.send_parts([b"head", memoryview(body)])
            with anyio.fail_after(WAIT):
                _, head, got = await router.recv_multipart()
            assert (head, got) == (b"head", bytes(body))
            with anyio.fail_after(WAIT):
                while not delivery.done:
                    await anyio.sleep(0.001)
        finally:
            await channel.aclose()
            router.close(linger=0)
