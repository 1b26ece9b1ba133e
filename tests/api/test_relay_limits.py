"""A hostile upstream (issue 26, item 4): a relay checks a version's head against the same
limits as an engine before it allocates or asks for anything, refuses a head past them
naming the version and bucket, skips that version and keeps running."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from aiosync.channels.base import PartsChannel
from aiosync.channels.zmq import ZmqListener
from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.layout import TensorSpec
from aiosync.core.limits import GiB, Limits
from aiosync.server import ServerConfig, WeightServer
from aiosync.server import messages as m
from aiosync.server.relay_checks import check_buckets, check_newer

WAIT = 30.0
KiB = 1 << 10


def bucket(data: bytes, name: str = "w") -> m.BucketHead:
    """A bucket head for ``data``: one float32 tensor, its true digest."""
    spec = TensorSpec(name, "float32", (len(data) // 4,), 0, len(data))
    return m.BucketHead(len(data), hashlib.sha256(data).digest(), [spec])


def claimed(used: int) -> m.BucketHead:
    """A bucket head claiming ``used`` bytes the upstream never has to send."""
    spec = TensorSpec("w", "uint8", (used,), 0, used)
    return m.BucketHead(used, bytes(32), [spec])


@dataclass
class Version:
    """What the fake upstream answers to one pull: a head, and the bytes of its buckets."""

    head: m.Head
    data: list[bytes] = field(default_factory=list)


@dataclass
class FakeUpstream:
    """Speaks a server's relay protocol, answering each pull with the next scripted version."""

    versions: list[Version]
    pulls: list[m.Pull] = field(default_factory=list)
    gets: list[m.Get] = field(default_factory=list)

    async def answer(self, channel: PartsChannel) -> None:
        current: Version | None = None
        try:
            while True:
                request = m.decode_request(await channel.recv())
                if isinstance(request, m.Pull):
                    self.pulls.append(request)
                    if not self.versions:
                        await anyio.sleep_forever()  # nothing newer, ever
                    current = self.versions.pop(0)
                    await channel.send(m.encode(current.head))
                elif isinstance(request, m.Get):
                    self.gets.append(request)
                    assert current is not None
                    start, end = request.offset, request.offset + request.nbytes
                    piece = current.data[request.bucket][start:end]
                    chunk = m.Chunk(request.version, request.bucket, start, len(piece))
                    await channel.send_parts([m.encode(chunk), piece])
        except AiosyncError:
            return  # the relay hung up


@asynccontextmanager
async def relay_of(
    upstream: FakeUpstream, limits: Limits | None = None
) -> AsyncIterator[WeightServer]:
    """A relay server pulling from ``upstream`` (ipc://, in a private directory)."""
    listener = ZmqListener.open()
    try:
        async with anyio.create_task_group() as tg:

            async def accept() -> None:
                while True:
                    tg.start_soon(upstream.answer, await listener.accept())

            tg.start_soon(accept)
            config = ServerConfig(
                upstream=str(listener.endpoint),
                upstream_limits=Limits() if limits is None else limits,
                timeout=WAIT,
            )
            async with WeightServer(config) as relay:
                yield relay
            tg.cancel_scope.cancel()
    finally:
        await listener.aclose()


async def retained(relay: WeightServer, version: int) -> None:
    with anyio.fail_after(WAIT):
        while relay.newest != version:
            await anyio.sleep(0.01)


async def failure(relay: WeightServer, unlike: Exception | None = None) -> Exception:
    """The relay's next failure (one that is not ``unlike``)."""
    assert relay.relay is not None
    with anyio.fail_after(WAIT):
        while relay.relay.last_error in (None, unlike):
            await anyio.sleep(0.01)
    assert relay.relay.last_error is not None
    return relay.relay.last_error


async def test_a_one_tib_bucket_is_refused_and_the_relay_goes_on() -> None:
    good, other = b"\x01" * 64, b"\x02" * 64
    upstream = FakeUpstream(
        [
            Version(m.Head(7, [claimed(1 << 40)])),  # the 1 TiB bucket: never allocated
            Version(m.Head(8, [bucket(good)]), [good]),
            Version(m.Head(8, [bucket(other)]), [other]),  # 8 again: not taken over 8
        ]
    )
    async with relay_of(upstream) as relay:
        assert relay.relay is not None
        error = await failure(relay)
        assert isinstance(error, ProtocolError)
        assert "bucket 0 of 1099511627776 bytes" in str(error)
        assert "version 7" in str(error)
        assert relay.relay.refused == 7
        await retained(relay, 8)  # the relay kept running and took the next version
        again = await failure(relay, error)
        assert "version 8 is not newer than 8" in str(again)
        haves = [pull.have for pull in upstream.pulls]
        assert haves[:2] == [None, 7]  # 7 is not asked for again
        assert set(haves[2:]) == {8}
        assert [(get.version, get.bucket) for get in upstream.gets] == [(8, 0)]
        assert relay.store.versions == [8]
        assert relay.store.held_bytes == len(good)
        assert relay.relay.bytes_fetched == len(good)


async def test_many_buckets_past_the_limit_are_refused_before_anything_is_held() -> None:
    limit = 1 << 20
    limits = Limits(max_session_bytes=limit, max_buffers=64)
    same = b"\x02" * (64 * KiB)  # one bucket's content, repeated: fetched once, held 64 times
    distinct = [bytes([i]) * (64 * KiB) for i in range(16)]  # exactly the limit
    upstream = FakeUpstream(
        [
            Version(m.Head(1, [bucket(same)] * 64), [same] * 64),
            Version(m.Head(2, [bucket(data) for data in distinct]), distinct),
        ]
    )
    async with relay_of(upstream, limits) as relay:
        assert relay.relay is not None
        error = await failure(relay)
        # refused from the head alone: nothing asked for, received or held
        assert "bucket 16 of 65536 bytes: the version would hold 1114112 bytes" in str(error)
        assert "version 1" in str(error)
        assert upstream.gets == []
        assert relay.store.held_bytes == 0
        assert relay.relay.held.nbytes == 0
        await retained(relay, 2)  # a version within the limits still comes through
        assert [get.version for get in upstream.gets] == [2] * 16
        assert relay.store.held_bytes <= limit
        assert relay.relay.bytes_fetched == limit


async def test_a_reply_past_max_message_bytes_is_refused() -> None:
    """Since issue 29 libzmq drops a frame past the limit with the connection, before
    buffering it (it was read whole, then refused): the error says so."""
    names = [bucket(b"\x03" * 64, name="n" * 1000 + str(i)) for i in range(64)]
    upstream = FakeUpstream([Version(m.Head(1, names))])  # a head of about 66 KB
    async with relay_of(upstream, Limits(max_message_bytes=16 * KiB)) as relay:
        error = str(await failure(relay))
        assert "went while the answer to pull was awaited" in error
        assert "a frame over max_message_bytes, 16384 bytes" in error
        assert upstream.gets == []
        assert relay.store.held_bytes == 0


def head(*buckets: m.BucketHead, version: int = 1) -> m.Head:
    return m.Head(version, list(buckets))


SMALL = Limits(
    max_buffers=4,
    max_session_bytes=1 << 20,
    max_bucket_tensors=2,
    max_manifest_tensors=3,
    max_name_length=8,
)
OK = bucket(b"\x04" * 64)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (head(), "0 buckets (1-4 per version)"),
        (head(*[OK] * 5), "5 buckets (1-4 per version)"),
        (head(OK, claimed(1 << 20)), "bucket 1 of 1048576 bytes: the version would hold"),
        (head(m.BucketHead(0, bytes(32), OK.specs)), "bucket 0 of 0 bytes"),
        (head(m.BucketHead(64, b"short", OK.specs)), "bucket 0 has a malformed digest"),
        (head(m.BucketHead(64, OK.digest, [])), "bucket 0 of 0 tensors (1-2)"),
        (head(m.BucketHead(64, OK.digest, OK.specs * 3)), "bucket 0 of 3 tensors (1-2)"),
        (head(bucket(b"\x05" * 64, name="x" * 9)), "tensor name of 9 characters"),
        (
            head(m.BucketHead(64, OK.digest, [TensorSpec("w", "float99", (16,), 0, 64)])),
            "bucket 0: unknown dtype 'float99'",
        ),
        (
            head(m.BucketHead(64, OK.digest, [TensorSpec("w", "float32", (-16,), 0, 64)])),
            "bucket 0: a negative dimension",
        ),
        (
            head(m.BucketHead(64, OK.digest, [TensorSpec("w", "float32", (16,), 32, 64)])),
            "bucket 0: spec outside its 64-byte bucket",
        ),
        (
            head(*[bucket(b"\x06" * 64, name=n) for n in "abcd"]),
            "more than 3 tensors by bucket 3",
        ),
    ],
)
def test_heads_past_the_limits_are_refused_naming_version_and_bucket(
    bad: m.Head, says: str
) -> None:
    with pytest.raises(ProtocolError, match="version 1") as refused:
        check_buckets(bad, SMALL)
    assert says in str(refused.value)


def test_heads_within_the_limits_pass() -> None:
    check_buckets(head(*[OK] * 4), Limits(max_buffers=4, max_session_bytes=256))
    check_buckets(head(claimed(256 * GiB)), Limits())  # the default bound, exactly


def test_versions_must_grow_by_any_step() -> None:
    check_newer(5, None)  # the first may be any
    check_newer(5 + 10 * Limits().max_version_step, 5)  # a relay skips what it missed
    with pytest.raises(ProtocolError, match="version 5 is not newer than 5"):
        check_newer(5, 5)


async def test_bytes_unlike_their_digest_are_refused_and_what_matched_is_kept() -> None:
    """Issue 29: every bucket is checked against its digest as it lands in its segment; a
    bucket that fails is refused naming it, and the next attempt fetches only that one."""
    good, wanted = b"\x07" * 64, b"\x08" * 64
    claims = m.Head(1, [bucket(good), bucket(wanted, name="v")])
    upstream = FakeUpstream(
        [
            Version(claims, [good, b"\x09" * 64]),  # bucket 1's bytes are not what it claims
            Version(claims, [good, wanted]),
        ]
    )
    async with relay_of(upstream) as relay:
        assert relay.relay is not None
        error = await failure(relay)
        assert isinstance(error, ProtocolError)
        assert "bucket 1 does not match its digest" in str(error)
        assert "version 1" in str(error)
        await retained(relay, 1)
        asked = [(get.version, get.bucket) for get in upstream.gets]
        assert asked == [(1, 0), (1, 1), (1, 1)]  # bucket 0 was kept from the first attempt
        assert relay.relay.bytes_fetched == 2 * 64  # those that matched their digest
        assert relay.relay.bytes_reused == 64
