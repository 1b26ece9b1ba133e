"""The ZMQ trust boundary: keys on tcp, peers that never read, chosen routing ids, dying engines.

Peers here are hostile on purpose: a client with a key the engine does not allow, one with
no key, one that floods and never reads its replies, one that picks the ROUTER's next
routing id. Listeners that an attack could abort run in a child process of their own.
Every test waits on events with generous hang guards; none measures time beyond "far
below the configured timeout".
"""

from __future__ import annotations

import logging
import os
import re
import resource
import signal
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from aiosync import (
    AiosyncError,
    ModuleSink,
    PeerGoneError,
    ReceiverConfig,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.channels.keys import (
    ChannelAuth,
    generate_keypair,
    load_keypair,
    load_public_key,
    load_public_keys,
)
from aiosync.channels.zmq import (
    ZmqChannel,
    ZmqListener,
    is_loopback_endpoint,
    private_ipc_endpoint,
)
from aiosync.core.wire import Abort, decode
from aiosync.runtime import child_env
from tests.helpers.channel_helpers import GUARD, Served, recv, serving
from tests.helpers.models import assert_same, mixed_weights, zeros_like

LONG = 600.0  # a configured timeout the tests must stay far below
LOOPBACK = "tcp://127.0.0.1:*"
INSECURE = ChannelAuth(insecure_loopback=True)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """Two keypairs, an engine's and a trainer's, and a stranger's the engine never listed."""

    directory: Path
    server: ChannelAuth
    client: ChannelAuth
    stranger: ChannelAuth
    server_secret: Path
    allowed: Path


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    server_public, server_secret = generate_keypair(tmp_path / "engine", "engine")
    client_public, client_secret = generate_keypair(tmp_path / "trainer", "trainer")
    _, stranger_secret = generate_keypair(tmp_path / "stranger", "stranger")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "trainer.key").write_bytes(client_public.read_bytes())
    return Keys(
        directory=tmp_path,
        server=ChannelAuth.server(server_secret, allowed),
        client=ChannelAuth.client(client_secret, server_public),
        stranger=ChannelAuth.client(stranger_secret, server_public),
        server_secret=server_secret,
        allowed=allowed,
    )


@asynccontextmanager
async def listening(listener: ZmqListener) -> AsyncIterator[Served]:
    async with serving(listener) as served:
        yield served


@asynccontextmanager
async def connected(endpoint: str, auth: ChannelAuth | None) -> AsyncIterator[ZmqChannel]:
    channel = ZmqChannel.connect(endpoint, auth=auth)
    try:
        yield channel
    finally:
        await channel.aclose()


def dealer(
    ctx: zmq.asyncio.Context,
    *,
    auth: ChannelAuth | None = None,
    routing_id: bytes | None = None,
    rcvhwm: int | None = None,
) -> zmq.asyncio.Socket:
    """A raw DEALER a hostile peer controls (options set before it connects)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.RCVBUF, 4096)
    if auth is not None and auth.has_keys:
        public, secret, server = auth.client_keys()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return sock


HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


async def handshake_of(sock: zmq.asyncio.Socket, endpoint: str, first: bytes) -> int:
    """Connect ``sock``, send ``first`` and return how its first handshake ended."""
    monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
    try:
        sock.connect(endpoint)
        await sock.send(first)
        with anyio.fail_after(GUARD):
            event = parse_monitor_message(await monitor.recv_multipart())
        return int(event["event"])
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def next_routing_id(identity: bytes) -> bytes:
    """The routing id a ROUTER assigns after ``identity``: a zero byte and a 32-bit counter."""
    assert len(identity) == 5, identity
    assert identity[0] == 0, identity
    return b"\0" + struct.pack(">I", (struct.unpack(">I", identity[1:])[0] + 1) % 2**32)


# --------------------------------------------------------------------------------------
# keys and key files
# --------------------------------------------------------------------------------------


def test_keygen_command_writes_a_keypair_whose_secret_only_its_owner_reads(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "keys"
    out = subprocess.run(
        [sys.executable, "-m", "aiosync", "keygen", str(directory), "--name", "engine"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=GUARD * 4,
    )
    assert out.returncode == 0, out.stderr
    public, secret = directory / "engine.key", directory / "engine.key_secret"
    assert str(public) in out.stdout
    assert str(secret) in out.stdout
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert zmq.auth.load_certificate(public)[1] is None  # the public file holds no secret
    public_key, secret_key = load_keypair(secret)
    assert load_public_key(public) == public_key
    assert zmq.curve_public(secret_key) == public_key
    assert public_key.decode() in out.stdout  # the line to hand to the other side
    assert sorted(p.name for p in directory.iterdir()) == ["engine.key", "engine.key_secret"]

    again = subprocess.run(
        [sys.executable, "-m", "aiosync", "keygen", str(directory), "--name", "engine"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=GUARD * 4,
    )
    assert again.returncode == 1
    assert "exists; not overwritten" in again.stderr
    assert again.stderr.count("\n") == 1  # one line, no traceback
    assert load_keypair(secret) == (public_key, secret_key)  # untouched


def test_key_files_are_checked(tmp_path: Path) -> None:
    public, secret = generate_keypair(tmp_path, "k")
    with pytest.raises(AiosyncError, match="exists; not overwritten"):
        generate_keypair(tmp_path, "k")
    with pytest.raises(AiosyncError, match="bad key name"):
        generate_keypair(tmp_path, "../escape")
    public.chmod(0o600)
    with pytest.raises(AiosyncError, match="holds no secret key"):
        load_keypair(public)
    secret.chmod(0o640)
    with pytest.raises(AiosyncError, match="chmod 600"):
        load_keypair(secret)
    secret.chmod(0o600)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AiosyncError, match="no public key files"):
        load_public_keys(empty)
    assert load_public_keys(tmp_path) == {load_public_key(public)}
    assert load_public_keys(public) == {load_public_key(public)}


def test_channel_auth_refuses_keys_that_do_not_fit_and_hides_the_secret() -> None:
    public, secret = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    with pytest.raises(AiosyncError, match="does not belong"):
        ChannelAuth(public_key=other_public, secret_key=secret)
    with pytest.raises(AiosyncError, match="both"):
        ChannelAuth(public_key=public)
    with pytest.raises(AiosyncError, match="not a CURVE key"):
        ChannelAuth(server_key=b"too short")
    auth = ChannelAuth(public_key=public, secret_key=secret, allowed_clients=[other_public])
    assert secret.decode() not in repr(auth)
    assert auth.allowed_clients == frozenset([other_public])
    assert auth.server_keys() == (public, secret, frozenset([other_public]))
    with pytest.raises(AiosyncError, match="server's public key"):
        auth.client_keys()
    with pytest.raises(AiosyncError, match="allowed clients"):
        ChannelAuth(public_key=public, secret_key=secret).server_keys()


# --------------------------------------------------------------------------------------
# which endpoints need keys
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:*",
        "tcp://localhost:*",
        "tcp://[::1]:*",
        "tcp://0.0.0.0:*",
        "tcp://*:*",
        "TCP://0.0.0.0:*",
    ],
)
async def test_tcp_without_keys_is_refused_on_every_address(endpoint: str) -> None:
    for make in (ZmqListener, ZmqChannel.connect):
        with pytest.raises(AiosyncError, match="needs CURVE keys") as info:
            make(endpoint)
        assert "\n" not in str(info.value)
        assert endpoint in str(info.value)


@pytest.mark.parametrize(
    "endpoint", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://eth0:*", "tcp://10.1.2.3:*"]
)
async def test_insecure_option_allows_plain_tcp_on_loopback_only(endpoint: str) -> None:
    with pytest.raises(AiosyncError, match="not a loopback address"):
        ZmqListener(endpoint, auth=INSECURE)
    with pytest.raises(AiosyncError, match="not a loopback address"):
        ZmqChannel.connect(endpoint.replace("*", "5555"), auth=INSECURE)


def test_loopback_endpoints() -> None:
    for yes in ("tcp://127.0.0.1:1", "tcp://127.1.2.3:1", "tcp://[::1]:1", "tcp://localhost:1"):
        assert is_loopback_endpoint(yes), yes
    for no in (
        "tcp://0.0.0.0:1",
        "tcp://*:1",
        "tcp://lo:1",
        "tcp://10.0.0.1:1",
        "tcp://example.com:1",
        "tcp://10.0.0.1;127.0.0.1",  # no port: not parsed as loopback
        "ipc:///tmp/x",
    ):
        assert not is_loopback_endpoint(no), no


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("endpoint", [LOOPBACK, "tcp://[::1]:*"])
async def test_insecure_loopback_carries_plain_tcp(endpoint: str) -> None:
    if "::1" in endpoint and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    async with (
        listening(ZmqListener(endpoint, auth=INSECURE)) as served,
        connected(served.endpoint, INSECURE) as client,
    ):
        assert not served.listener.curve
        await client.send(b"plain")
        peer = await served.next_peer()
        assert await recv(peer) == b"plain"


async def test_ipc_needs_no_keys_and_its_default_directory_is_private() -> None:
    listener = ZmqListener.open()
    path = Path(listener.endpoint.removeprefix("ipc://"))
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.parent.stat().st_uid == os.getuid()
    finally:
        await listener.aclose()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
async def test_another_user_cannot_reach_the_default_ipc_endpoint() -> None:
    """The default endpoint is safe from the routing-id attack: no other user connects."""
    async with listening(ZmqListener.open()) as served:
        path = served.endpoint.removeprefix("ipc://")
        pid = os.fork()
        if pid == 0:  # the child: become nobody and try the socket
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(path)
                    code = 1
                except PermissionError:
                    code = 0
                except OSError:
                    code = 2
            finally:
                os._exit(code)
        _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # refused with EACCES


# --------------------------------------------------------------------------------------
# CURVE: the right key talks, any other is refused before a message gets through
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_right_key_talks_and_others_are_refused_before_any_message(
    keys: Keys, transport: str
) -> None:
    if transport == "tcp":
        listener = ZmqListener(LOOPBACK, auth=keys.server)
    else:
        listener = ZmqListener.open(auth=keys.server)
    wrong_server = ChannelAuth(
        public_key=keys.client.public_key,
        secret_key=keys.client.secret_key,
        server_key=keys.stranger.public_key,
    )
    async with listening(listener) as served:
        assert served.listener.curve
        # a key the engine does not list
        async with connected(served.endpoint, keys.stranger) as stranger:
            await stranger.send(b"let me in")
            with pytest.raises(AiosyncError, match="does not allow this side's CURVE key"):
                await recv(stranger)
            assert stranger.lost.is_set()
            with pytest.raises(AiosyncError, match="does not allow"):  # and from then on
                await stranger.recv()
        # the right client key, but the wrong idea of the server's key
        async with connected(served.endpoint, wrong_server) as confused:
            await confused.send(b"is that you?")
            with pytest.raises(AiosyncError, match=r"security handshake .* failed"):
                await recv(confused)
        # no keys at all (plain tcp on loopback, or plain ipc)
        plain = INSECURE if transport == "tcp" else None
        async with connected(served.endpoint, plain) as keyless:
            await keyless.send(b"no key")
            with pytest.raises(AiosyncError, match=r"security handshake .* failed"):
                await recv(keyless)
        assert served.pending() == 0  # the engine has seen none of them
        # the trainer's key
        async with connected(served.endpoint, keys.client) as trainer:
            await trainer.send(b"hello")
            peer = await served.next_peer()
            assert await recv(peer) == b"hello"  # the first message the engine ever got
            await peer.send(b"ready")
            assert await recv(trainer) == b"ready"
            assert re.fullmatch(r"peer-\d+", peer.peer)


async def test_weights_stream_over_tcp_with_keys_and_strangers_are_turned_away(
    keys: Keys,
) -> None:
    weights = mixed_weights()
    target = zeros_like(weights)
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=LONG)
    async with WeightReceiver(ModuleSink(target), LOOPBACK, auth=keys.server) as receiver:
        with pytest.raises(AiosyncError, match="needs CURVE keys"):
            async with WeightSender(receiver.endpoint, config=config):
                pass
        with anyio.fail_after(GUARD):  # refused at once, far below the sender's timeout
            with pytest.raises(AiosyncError, match="does not allow this side's CURVE key"):
                async with WeightSender(receiver.endpoint, config=config, auth=keys.stranger):
                    pass
        assert receiver.sessions == 0
        assert receiver.protocol_errors == 0  # it never saw the stranger
        async with WeightSender(receiver.endpoint, config=config, auth=keys.client) as sender:
            await sender.send(weights.items(), version=0)
        assert receiver.current_version == 0
        assert_same(target, {k: v.contiguous() for k, v in weights.items()})


# --------------------------------------------------------------------------------------
# routing ids: chosen ones never shown, and the next automatic one cannot be squatted
# --------------------------------------------------------------------------------------


async def test_peers_are_named_by_the_listener_not_by_their_routing_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chosen = b"ATTACKER-CHOSEN-ID"
    caplog.set_level(logging.DEBUG)
    ctx = zmq.asyncio.Context()
    async with WeightReceiver(ModuleSink({})) as receiver:
        rogue = dealer(ctx, routing_id=chosen)
        try:
            rogue.connect(receiver.endpoint)
            for junk in (b"\xff junk", b"more junk"):
                await rogue.send(junk)
                with anyio.fail_after(GUARD):
                    reply = decode(await rogue.recv())
                assert isinstance(reply, Abort)
                for shown in (chosen.decode(), chosen.hex()):
                    assert shown not in reply.reason
        finally:
            rogue.close(linger=0)
            ctx.term()
    for text in (chosen.decode(), chosen.hex()):
        assert not any(text in record.getMessage() for record in caplog.records)
    assert any(re.search(r"peer-\d+", record.getMessage()) for record in caplog.records)


ROUTING_CHILD = """
import sys
import anyio
from aiosync.channels.keys import ChannelAuth
from aiosync.channels.zmq import ZmqListener

async def echo(peer):
    while True:
        await peer.send(await peer.recv())

async def main():
    keypair, allowed = sys.argv[1:3]
    if keypair == "-":
        auth = ChannelAuth(insecure_loopback=True)
    else:
        auth = ChannelAuth.server(keypair, allowed)
    listener = ZmqListener("tcp://127.0.0.1:*", auth=auth)
    print("ready", listener.endpoint, flush=True)
    async with anyio.create_task_group() as tg:
        while True:
            peer = await listener.accept()
            print("peer", peer.identity.hex(), flush=True)  # the test's view, not the engine's
            tg.start_soon(echo, peer)

anyio.run(main)
"""


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@contextmanager
def routing_child(keys: Keys | None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A listener in a process of its own (an abort must not take the tests with it)."""
    argv = ["-", "-"] if keys is None else [str(keys.server_secret), str(keys.allowed)]
    proc = subprocess.Popen(
        [sys.executable, "-c", ROUTING_CHILD, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
        preexec_fn=_no_core_dump,
    )
    try:
        assert proc.stdout is not None
        word, endpoint = proc.stdout.readline().split()
        assert word == "ready"
        yield proc, endpoint
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=GUARD)
        assert proc.stdout is not None
        proc.stdout.close()


async def _next_identity(proc: subprocess.Popen[str]) -> bytes:
    assert proc.stdout is not None
    with anyio.fail_after(GUARD):
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
    word, identity = line.split()
    assert word == "peer"
    return bytes.fromhex(identity)


async def _echoes(endpoint: str, auth: ChannelAuth, message: bytes) -> None:
    async with connected(endpoint, auth) as client:
        await client.send(message)
        assert await recv(client) == message


@pytest.mark.parametrize("attacker", ["stranger-key", "no-key"])
async def test_squatting_the_next_routing_id_cannot_abort_a_curve_listener(
    keys: Keys, attacker: str
) -> None:
    """libzmq aborts a ROUTER when a peer holds the id it gives the next peer; with CURVE a
    peer without an allowed key never gets that far, so its chosen id is never registered."""
    with routing_child(keys) as (proc, endpoint):
        await _echoes(endpoint, keys.client, b"first trainer")
        squatted = next_routing_id(await _next_identity(proc))
        ctx = zmq.asyncio.Context()
        try:
            auth = keys.stranger if attacker == "stranger-key" else None
            rogue = dealer(ctx, auth=auth, routing_id=squatted)
            try:
                ended = await handshake_of(rogue, endpoint, b"squat")
            finally:
                rogue.close(linger=0)
        finally:
            ctx.term()
        assert ended != zmq.EVENT_HANDSHAKE_SUCCEEDED
        await _echoes(endpoint, keys.client, b"second trainer")  # gets the squatted id itself
        assert await _next_identity(proc) == squatted
        assert proc.poll() is None  # alive


async def test_the_same_squat_aborts_an_insecure_loopback_listener() -> None:
    """The control for the test above, and the risk ``insecure_loopback`` leaves (see
    docs/security.md): without keys any local user can pick the next id and abort it."""
    with routing_child(None) as (proc, endpoint):
        await _echoes(endpoint, INSECURE, b"first trainer")
        squatted = next_routing_id(await _next_identity(proc))
        ctx = zmq.asyncio.Context()
        rogue = dealer(ctx, routing_id=squatted)
        try:
            assert await handshake_of(rogue, endpoint, b"squat") == zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert await _next_identity(proc) == squatted
            async with connected(endpoint, INSECURE) as victim:
                await victim.send(b"second trainer")
                with pytest.raises(PeerGoneError):
                    await recv(victim)
        finally:
            rogue.close(linger=0)
            ctx.term()
        with anyio.fail_after(GUARD):
            code = await anyio.to_thread.run_sync(proc.wait)
        assert code == -signal.SIGABRT


# --------------------------------------------------------------------------------------
# a peer that never reads its replies
# --------------------------------------------------------------------------------------


async def test_a_peer_that_never_reads_is_dropped_and_replies_never_wait() -> None:
    listener = ZmqListener.open()
    ctx = zmq.asyncio.Context()
    async with listening(listener) as served:
        idle = dealer(ctx, rcvhwm=1)
        try:
            idle.connect(served.endpoint)
            await idle.send(b"hi")
            peer = await served.next_peer()
            assert await recv(peer) == b"hi"
            reply = b"r" * 65536
            sent = 0
            refused: PeerGoneError | None = None
            with anyio.fail_after(GUARD):
                while refused is None:
                    with anyio.CancelScope() as scope:
                        scope.cancel()  # a reply that waited at all would be cancelled here
                        try:
                            await peer.send(reply)
                        except PeerGoneError as exc:
                            refused = exc
                    assert not scope.cancelled_caught
                    sent += 1
                    if sent % 64 == 0:
                        await anyio.sleep(0.01)  # let the I/O thread move what it can
            assert "does not read its replies" in str(refused)
            assert peer.lost.is_set()
            with pytest.raises(PeerGoneError):
                await peer.recv()
            with pytest.raises(PeerGoneError):
                await peer.send(b"more")
            # the dropped peer's later messages are ignored, not a new peer
            await idle.send(b"still here")
            async with connected(served.endpoint, None) as good:
                await good.send(b"served?")
                fresh = await served.next_peer()
                assert await recv(fresh) == b"served?"
                await fresh.send(b"yes")
                assert await recv(good) == b"yes"
            assert served.pending() == 0
        finally:
            idle.close(linger=0)
            ctx.term()


async def test_engine_keeps_serving_a_trainer_while_a_peer_floods_and_never_reads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Thousands of junk frames, each answered, none read: the engine drops that peer and a
    trainer streams meanwhile.

    A reply that waited for the flooder would hold the serving loop for ``reply_timeout``
    (here far beyond the sender's timeout and the guard) on each of its replies.
    """
    weights = mixed_weights()
    target = zeros_like(weights)
    receiver_config = ReceiverConfig(reply_timeout=LONG)
    sender_config = SenderConfig(buffer_bytes=64 * 1024, timeout=LONG / 4)

    def dropped() -> bool:
        return any("does not read its replies" in r.getMessage() for r in caplog.records)

    ctx = zmq.asyncio.Context()
    flooder = dealer(ctx, rcvhwm=1)
    flooder.setsockopt(zmq.SNDHWM, 0)
    sent = 0

    async def flood() -> None:
        nonlocal sent
        while True:
            for _ in range(100):
                await flooder.send(b"junk %d" % sent)
                sent += 1
            await anyio.sleep(0.002)  # paced, so that the engine answers most of them

    try:
        async with (
            WeightReceiver(ModuleSink(target), config=receiver_config) as receiver,
            anyio.create_task_group() as tg,
        ):
            flooder.connect(receiver.endpoint)
            tg.start_soon(flood)
            with anyio.fail_after(GUARD):
                while not dropped():
                    await anyio.sleep(0.01)
            with anyio.fail_after(GUARD):  # while the flood goes on
                async with WeightSender(receiver.endpoint, config=sender_config) as sender:
                    for version in range(2):
                        await sender.send(weights.items(), version=version)
            tg.cancel_scope.cancel()
            assert receiver.current_version == 1
            assert_same(target, {k: v.contiguous() for k, v in weights.items()})
    finally:
        flooder.close(linger=0)
        ctx.term()
    assert sent > 1000


# --------------------------------------------------------------------------------------
# an engine that dies during the hello
# --------------------------------------------------------------------------------------


SILENT_ENGINE = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("ready", flush=True)
sock.recv_multipart()
print("hello", flush=True)
time.sleep(3600)  # never answers
"""


async def test_sender_notices_an_engine_killed_during_the_hello_at_once() -> None:
    endpoint, directory = private_ipc_endpoint("silent")
    proc = subprocess.Popen(
        [sys.executable, "-c", SILENT_ENGINE, endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        config = SenderConfig(buffer_bytes=64 * 1024, timeout=LONG)
        errors: list[BaseException] = []

        async def say_hello() -> None:
            try:
                async with WeightSender(endpoint, config=config):
                    pass
            except AiosyncError as exc:
                errors.append(exc)

        with anyio.fail_after(GUARD):  # far below the sender's timeout
            async with anyio.create_task_group() as tg:
                tg.start_soon(say_hello)
                line = await anyio.to_thread.run_sync(proc.stdout.readline)
                assert line.strip() == "hello"  # the hello arrived; no reply will come
                proc.send_signal(signal.SIGKILL)
        assert len(errors) == 1
        assert isinstance(errors[0], PeerGoneError)
        assert "disconnected" in str(errors[0])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=GUARD)
        assert proc.stdout is not None
        proc.stdout.close()
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()
