"""Control channels: ZMQ (either role binds or connects) and in-process pairs.

Every test waits on events with generous hang guards; none measures time.
"""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import pytest
import torch
import zmq
import zmq.asyncio

from aiosync import ModuleSink, PeerGoneError, SenderConfig, WeightReceiver, WeightSender
from aiosync.channels.base import Channel
from aiosync.channels.inproc import InprocChannel, InprocListener, inproc_pair
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.zmq import RouterPeer, ZmqChannel, ZmqListener, private_ipc_endpoint
from aiosync.core.engine_actions import OpenPlane, Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import (
    PROTOCOL_MAX,
    Abort,
    Ack,
    Begin,
    Ready,
    ShmHandle,
    ShmPlaneSpec,
    decode,
    encode,
)
from aiosync.runtime import child_env
from tests.helpers.channel_helpers import GUARD, Served, recv, serving
from tests.helpers.models import assert_same, mixed_weights, zeros_like

INSECURE = ChannelAuth(insecure_loopback=True)  # plain tcp on loopback, for these tests only


@contextmanager
def private_endpoint(name: str = "chan") -> Iterator[tuple[str, Path]]:
    endpoint, directory = private_ipc_endpoint(name)
    try:
        yield endpoint, directory / f"{name}.sock"
    finally:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


@asynccontextmanager
async def listening(
    endpoint: str | None = None, auth: ChannelAuth | None = None
) -> AsyncIterator[Served]:
    """A bound listener (default: ``ipc://`` in a private directory), served, closed on exit."""
    async with serving(ZmqListener.open(endpoint, auth=auth)) as served:
        yield served


# --------------------------------------------------------------------------------------
# ZMQ: connect <-> listen
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("binder", ["engine", "trainer"])
async def test_connect_and_listen_carry_a_session_both_ways(binder: str) -> None:
    """Whoever binds, the two session machines talk through the channels unchanged.

    ZMQ's listener learns a peer from its first message, so the connecting side speaks
    first: the trainer's hello when the engine binds; when the trainer binds, a greeting
    from the engine, then the trainer's hello over the accepted channel.
    """
    engine = EngineSession(expectations=None, staged=True, stream_timeout=60, session_timeout=60)
    link = LinkSession("the-engine", "s-1")
    hello = link.hello("trainer", ShmPlaneSpec([ShmHandle("aiosync-1-2-0123456789abcdef", 512)]))
    async with listening() as listener:
        connector = ZmqChannel.connect(listener.endpoint)
        try:
            assert connector.peer == listener.endpoint
            assert connector.window is None
            trainer_side: Channel
            engine_side: Channel
            if binder == "engine":
                await connector.send(encode(hello))
                trainer_side, engine_side = connector, await listener.next_peer()
            else:
                await connector.send(b"engine here")
                trainer_side, engine_side = await listener.next_peer(), connector
                assert await recv(trainer_side) == b"engine here"
                await trainer_side.send(encode(hello))
            bound_side = engine_side if binder == "engine" else trainer_side
            assert isinstance(bound_side, RouterPeer)
            assert bound_side.peer.startswith("peer-")
            assert bound_side.window is None

            async def engine_turn() -> Ack | Ready:
                actions = engine.receive("peer", decode(await recv(engine_side)), 0.0)
                if isinstance(actions[0], OpenPlane):  # nothing to open: a plain test
                    actions = engine.plane_opened("peer")
                (reply,) = actions
                assert isinstance(reply, Reply)
                await engine_side.send(encode(reply.message))
                return reply.message  # type: ignore[return-value]

            await engine_turn()
            link.ready(decode(await recv(trainer_side)))  # type: ignore[arg-type]
            assert link.protocol == PROTOCOL_MAX
            for version in range(3):
                link.begin(version)
                await trainer_side.send(encode(Begin(version, [])))
                link.sent(0)
                assert await engine_turn() == Ack(version, 0, True)
                ack = link.ack(decode(await recv(trainer_side)))  # type: ignore[arg-type]
                assert ack == Ack(version, 0, True)
                engine.receive("peer", Abort("test over", version), 0.0)
                link.failed()
            # a burst each way keeps its order
            for i in range(50):
                await trainer_side.send(encode(Begin(i)))
                await engine_side.send(encode(Ack(i, 0, True)))
            assert [decode(await recv(engine_side)) for _ in range(50)] == [
                Begin(i) for i in range(50)
            ]
            assert [decode(await recv(trainer_side)) for _ in range(50)] == [
                Ack(i, 0, True) for i in range(50)
            ]
            assert not connector.lost.is_set()
        finally:
            await connector.aclose()


async def test_router_peer_replies_reach_only_their_own_peer() -> None:
    async with listening() as listener:
        a = ZmqChannel.connect(listener.endpoint)
        b = ZmqChannel.connect(listener.endpoint)
        try:
            await a.send(b"from a")
            peer_a = await listener.next_peer()
            await b.send(b"from b")
            peer_b = await listener.next_peer()
            assert peer_a.peer != peer_b.peer
            assert await recv(peer_a) == b"from a"
            assert await recv(peer_b) == b"from b"
            await peer_b.send(b"to b")
            await peer_a.send(b"to a")
            assert await recv(a) == b"to a"
            assert await recv(b) == b"to b"

            # a known peer's later messages are delivered by the accept loop, not accepted
            await a.send(b"again")
            assert await recv(peer_a) == b"again"
            # a peer channel closed by its owner: the identity's next message is a new peer
            await peer_a.aclose()
            with pytest.raises(PeerGoneError):
                await peer_a.recv()
            await a.send(b"after close")
            fresh = await listener.next_peer()
            assert fresh.identity == peer_a.identity
            assert fresh is not peer_a
            assert await recv(fresh) == b"after close"
        finally:
            await a.aclose()
            await b.aclose()


async def test_listener_close_removes_its_socket_file_and_private_directory() -> None:
    listener = ZmqListener.open()
    path = Path(listener.endpoint.removeprefix("ipc://"))
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert path.parent.stat().st_mode & 0o777 == 0o700  # only this user may connect
    await listener.aclose()
    assert not path.exists()
    assert not path.parent.exists()
    await listener.aclose()  # idempotent


# --------------------------------------------------------------------------------------
# ZMQ: addresses
# --------------------------------------------------------------------------------------


async def test_tcp_address_in_use_is_an_aiosync_error() -> None:
    async with listening("tcp://127.0.0.1:*", auth=INSECURE) as first:
        assert first.endpoint.startswith("tcp://127.0.0.1:")
        with pytest.raises(AiosyncError, match="address in use") as info:
            ZmqListener(first.endpoint, auth=INSECURE)
        assert first.endpoint in str(info.value)
    with socket.socket() as plain:  # a port held by something that is not zmq at all
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        endpoint = f"tcp://127.0.0.1:{plain.getsockname()[1]}"
        with pytest.raises(AiosyncError, match="address in use"):
            ZmqListener(endpoint, auth=INSECURE)


LISTENER_CHILD = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    sock.send_multipart(sock.recv_multipart())  # echo
"""


@contextmanager
def listener_process(endpoint: str) -> Iterator[subprocess.Popen[str]]:
    """A process of its own bound to ``endpoint`` (echoing), killed on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER_CHILD, endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=GUARD)
        assert proc.stdout is not None
        proc.stdout.close()


async def test_ipc_endpoint_of_a_live_listener_is_refused_not_taken_over() -> None:
    with private_endpoint() as (endpoint, path):
        # a listener of this process
        async with listening(endpoint) as first:
            with pytest.raises(AiosyncError, match="address in use") as info:
                ZmqListener(endpoint)
            assert endpoint in str(info.value)
            # the first listener still owns the address: a new peer still reaches it
            client = ZmqChannel.connect(endpoint)
            try:
                await client.send(b"still yours?")
                peer = await first.next_peer()
                assert await recv(peer) == b"still yours?"
            finally:
                await client.aclose()
        assert not path.exists()
        # a listener of another process
        with listener_process(endpoint):
            with pytest.raises(AiosyncError, match="address in use"):
                ZmqListener(endpoint)
            client = ZmqChannel.connect(endpoint)
            try:
                await client.send(b"echo")
                assert await recv(client) == b"echo"  # the other process still answers
            finally:
                await client.aclose()


async def test_stale_ipc_socket_file_of_a_dead_listener_is_reused() -> None:
    with private_endpoint() as (endpoint, path):
        with listener_process(endpoint) as proc:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=GUARD)
        assert stat.S_ISSOCK(path.stat().st_mode)  # left behind by the killed process
        async with listening(endpoint) as listener:
            client = ZmqChannel.connect(endpoint)
            try:
                await client.send(b"new owner")
                peer = await listener.next_peer()
                assert await recv(peer) == b"new owner"
            finally:
                await client.aclose()


async def test_stale_socket_file_not_made_by_zmq_is_reused() -> None:
    with private_endpoint() as (endpoint, path):
        left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        left.bind(str(path))
        left.close()  # the file stays, nobody listens
        assert path.exists()
        async with listening(endpoint) as listener:
            assert listener.endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["bogus://x", "nonsense", "tcp://127.0.0.1:notaport", "ipc:///no/such/dir/x.sock"],
)
async def test_bad_listen_address_is_an_aiosync_error_naming_it(endpoint: str) -> None:
    with pytest.raises(AiosyncError, match="bad address") as info:
        ZmqListener(endpoint, auth=INSECURE)
    assert endpoint in str(info.value)


@pytest.mark.parametrize("endpoint", ["bogus://x", "nonsense", "tcp://127.0.0.1:notaport"])
async def test_bad_connect_address_is_an_aiosync_error_naming_it(endpoint: str) -> None:
    with pytest.raises(AiosyncError, match="bad address") as info:
        ZmqChannel.connect(endpoint, auth=INSECURE)
    assert endpoint in str(info.value)


async def test_bad_address_given_to_a_sender_or_receiver_is_an_aiosync_error() -> None:
    with pytest.raises(AiosyncError, match="bad address 'bogus://x'"):
        async with WeightReceiver(ModuleSink({}), "bogus://x"):
            pass
    with pytest.raises(AiosyncError, match="bad address 'bogus://x'"):
        async with WeightSender("bogus://x", config=SenderConfig(buffer_bytes=4096)):
            pass


# --------------------------------------------------------------------------------------
# ZMQ: a peer that goes away
# --------------------------------------------------------------------------------------


async def test_recv_raises_peer_gone_when_the_listener_closes() -> None:
    listener = ZmqListener.open()
    client = ZmqChannel.connect(listener.endpoint)
    try:
        await client.send(b"hi")
        peer = await listener.accept()  # the first message comes with the new peer
        assert await recv(peer) == b"hi"
        errors: list[BaseException] = []
        receiving = anyio.Event()

        async def wait_for_reply() -> None:
            receiving.set()
            try:
                await client.recv()  # no reply will ever come
            except PeerGoneError as exc:
                errors.append(exc)

        with anyio.fail_after(GUARD):  # without the connection monitor this would hang
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_reply)
                await receiving.wait()
                await listener.aclose()
        assert client.lost.is_set()
        assert len(errors) == 1
        assert "disconnected" in str(errors[0])
        assert listener.endpoint in str(errors[0])
        with pytest.raises(PeerGoneError):  # and at once from then on
            await client.recv()
    finally:
        await listener.aclose()
        await client.aclose()


async def test_recv_raises_peer_gone_when_the_listening_process_dies() -> None:
    with private_endpoint() as (endpoint, _), listener_process(endpoint) as proc:
        client = ZmqChannel.connect(endpoint)
        try:
            await client.send(b"ping")
            assert await recv(client) == b"ping"
            with anyio.fail_after(GUARD):
                async with anyio.create_task_group() as tg:

                    async def expect_gone() -> None:
                        with pytest.raises(PeerGoneError, match="disconnected"):
                            await client.recv()

                    tg.start_soon(expect_gone)
                    proc.send_signal(signal.SIGKILL)
            assert client.lost.is_set()
        finally:
            await client.aclose()


async def test_router_peer_is_lost_once_its_peer_closed() -> None:
    async with listening() as listener:
        client = ZmqChannel.connect(listener.endpoint)
        await client.send(b"hi")
        peer = await listener.next_peer()
        await client.aclose()
        await client.aclose()  # idempotent
        with anyio.fail_after(GUARD):
            while True:  # the listener notices the dropped pipe on its own time
                try:
                    await peer.send(b"anyone?")
                except PeerGoneError:
                    break
                await anyio.sleep(0.05)
        assert peer.lost.is_set()


# --------------------------------------------------------------------------------------
# ZMQ: a caller's socket
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [zmq.PAIR, zmq.ROUTER, zmq.PUB, zmq.REP])
def test_wrap_refuses_sockets_that_cannot_talk_to_an_engine(kind: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    try:
        with pytest.raises(ValueError, match="REQ or DEALER"):
            ZmqChannel.wrap(sock)
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_wrap_drives_a_callers_req_socket_without_closing_it() -> None:
    async with listening() as listener:
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ)
        req.connect(listener.endpoint)
        try:
            channel = ZmqChannel.wrap(req)
            assert channel.window == 1  # one request awaiting its reply at a time
            assert channel.peer == listener.endpoint
            await channel.send(b"question")  # REQ adds an empty delimiter frame
            peer = await listener.next_peer()
            assert await recv(peer) == b"question"
            await peer.send(b"answer")  # and expects it back on the reply
            assert await recv(channel) == b"answer"
            for i in range(3):  # lock-step, as a REQ must
                await channel.send(b"q%d" % i)
                assert await recv(peer) == b"q%d" % i
                await peer.send(b"a%d" % i)
                assert await recv(channel) == b"a%d" % i
            await channel.aclose()
            assert not req.closed  # the caller's socket is the caller's
        finally:
            req.close(linger=0)
            ctx.term()


async def test_wrap_of_a_dealer_has_no_window() -> None:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert ZmqChannel.wrap(dealer).window is None
    finally:
        dealer.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------------------
# in-process channels
# --------------------------------------------------------------------------------------


async def test_inproc_pair_carries_messages_both_ways_and_reports_loss() -> None:
    mine, theirs = inproc_pair("t", window=3)
    assert isinstance(mine, InprocChannel)
    assert mine.peer.startswith("t-listener-")
    assert theirs.peer.startswith("t-")
    assert (mine.window, theirs.window) == (3, None)
    for i in range(10):
        await mine.send(encode(Begin(i)))
        await theirs.send(encode(Ack(i, 0, True)))
    assert [decode(await recv(theirs)) for _ in range(10)] == [Begin(i) for i in range(10)]
    assert [decode(await recv(mine)) for _ in range(10)] == [Ack(i, 0, True) for i in range(10)]
    assert not mine.lost.is_set()
    await theirs.aclose()
    assert mine.lost.is_set()
    with pytest.raises(PeerGoneError):
        await mine.recv()
    with pytest.raises(PeerGoneError):
        await mine.send(b"x")
    with pytest.raises(PeerGoneError):
        await theirs.recv()


async def test_inproc_recv_wakes_when_the_other_end_closes() -> None:
    mine, theirs = inproc_pair()
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tg:

            async def expect_gone() -> None:
                with pytest.raises(PeerGoneError):
                    await mine.recv()

            tg.start_soon(expect_gone)
            await anyio.sleep(0)
            await theirs.aclose()
    assert mine.lost.is_set()
    await mine.aclose()


async def test_inproc_listener_hands_out_the_other_end_and_closes_it() -> None:
    listener = InprocListener("engine")
    assert listener.endpoint == "inproc://engine"
    a = listener.connect()
    b = listener.connect(window=1)
    assert b.window == 1
    got_a = await listener.accept()
    got_b = await listener.accept()
    await a.send(b"a")
    await b.send(b"b")
    assert await recv(got_a) == b"a"
    assert await recv(got_b) == b"b"
    await got_b.send(b"to b")
    assert await recv(b) == b"to b"
    await listener.aclose()
    assert a.lost.is_set() and b.lost.is_set()  # noqa: PT018
    with pytest.raises(PeerGoneError):
        await a.recv()


async def test_sender_and_receiver_run_over_in_process_channels() -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    listener = InprocListener()
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=GUARD)
    async with WeightReceiver(ModuleSink(target), listener) as receiver:
        assert receiver.endpoint == listener.endpoint
        async with WeightSender(listener.connect(), config=config) as sender:
            for version in range(2):
                bumped = {
                    k: v + version if v.dtype != torch.bool else v for k, v in weights.items()
                }
                await sender.send(bumped.items(), version=version)
                assert receiver.current_version == version
                assert_same(target, {k: v.contiguous() for k, v in bumped.items()})
    await listener.aclose()  # the caller's listener is the caller's to close
