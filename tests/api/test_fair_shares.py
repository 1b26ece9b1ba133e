"""Fair shares under load from one peer (issue 26, item 8).

Each attack of the issue runs against a live engine or server, mounted by raw ZMQ peers:
one key holding every session slot (and, on ipc, pinging sessions holding them), floods of
frames queued while the engine applies, abandoned begins of large manifests, segments that
claim bytes they never reserved, one client holding every control channel of a server and
receivers that never answer a hello. What the engine holds is read from its own counts
(``WeightReceiver.holding``), and a legitimate trainer (or subscriber) still completes a
version while each attack runs.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import tracemalloc
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from aiosync import CallbackSink, ModuleSink, ReceiverConfig, WeightReceiver, WeightSender
from aiosync.channels.keys import ChannelAuth, generate_keypair, load_public_key
from aiosync.channels.zmq import ZmqChannel, ZmqListener
from aiosync.core.engine_actions import Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.limits import Limits
from aiosync.core.manifest import TensorMeta
from aiosync.core.shares import holder, idle_victim, over_share
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import (
    Abort,
    Ack,
    Begin,
    Challenge,
    ManifestMemo,
    Ping,
    Ready,
    ShmHandle,
    ShmPlaneSpec,
    decode,
    encode,
)
from aiosync.planes.shm import ShmSenderPlane
from aiosync.private_dirs import pid_namespace
from aiosync.server import ServerConfig, Subscriber, WeightServer
from aiosync.server import messages as m
from aiosync.server import server as server_module
from tests.api.test_server import SMALL, empty, model, same

WAIT = 30.0
MODEL = {"w": torch.zeros(64), "b": torch.zeros(8)}


def weights(version: int) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, float(version)) for name, t in MODEL.items()}


class Raw:
    """A hand-driven peer of an engine: a channel, and one small plane to name in hellos."""

    def __init__(self, channel: ZmqChannel, plane: ShmSenderPlane | None = None) -> None:
        self.channel = channel
        self.plane = plane or ShmSenderPlane(1, 1 << 16)
        self.session = secrets.token_hex(8)

    @classmethod
    def connect(cls, endpoint: str, auth: ChannelAuth | None = None) -> Raw:
        return cls(ZmqChannel.connect(endpoint, auth=auth))

    async def hello(self, spec: ShmPlaneSpec | None = None) -> Ready | Abort:
        plane = spec or self.plane.spec
        hello = LinkSession("engine", self.session).hello("attacker", plane)
        return await self.ask(hello)  # type: ignore[return-value]

    async def ask(self, message: object) -> object:
        await self.channel.send(encode(message))  # type: ignore[arg-type]
        with anyio.fail_after(WAIT):
            return decode(await self.channel.recv())

    async def ping(self) -> None:
        await self.channel.send(encode(Ping(self.session)))

    async def close(self) -> None:
        await self.channel.aclose()
        self.plane.close()


async def commits(endpoint: str, version: int, auth: ChannelAuth | None = None) -> None:
    """A legitimate trainer sends ``version`` to the engine at ``endpoint``; it commits."""
    async with WeightSender(endpoint, config=SMALL, auth=auth) as sender:
        report = await sender.send(weights(version), version=version)
        assert report.committed


# --------------------------------------------------------------------------------------
# the rules, pure
# --------------------------------------------------------------------------------------


def test_a_holder_is_its_key_or_else_the_peer() -> None:
    assert holder("peer-1", b"K" * 40) == holder("peer-2", b"K" * 40)
    assert holder("peer-1", None) != holder("peer-2", None)
    held = [holder("a", b"K" * 40)] * 2
    assert over_share(held, holder("c", b"K" * 40), 3) is None
    assert "holds 2 of them (at most 2 each)" in (over_share(held, held[0], 2) or "")
    assert over_share(held, holder("c", None), 2) is None


def test_the_slot_that_goes_is_the_longest_idle_of_the_biggest_holder() -> None:
    holders: dict[Hashable, Hashable] = {"a": "x", "b": "x", "c": "y"}
    since: dict[Hashable, float | None] = {"a": 5.0, "b": 2.0, "c": 0.0}
    assert idle_victim(since, holders, now=10.0, bound=1.0) == "b"  # x holds two
    assert idle_victim({**since, "a": None, "b": None}, holders, now=10.0, bound=1.0) == "c"
    assert idle_victim(since, holders, now=10.0, bound=60.0) is None  # nobody idle so long


def machine(**limits: int) -> EngineSession:
    keys = {"k1": b"A" * 40, "k2": b"A" * 40, "k3": b"A" * 40, "other": b"B" * 40}
    return EngineSession(
        expectations=None,
        staged=False,
        stream_timeout=10,
        session_timeout=5,
        limits=Limits(**limits),  # type: ignore[arg-type]
        key_of=lambda peer: keys.get(str(peer)),
    )


def open_session(engine: EngineSession, peer: str, now: float) -> list[object]:
    plane = ShmPlaneSpec([ShmHandle("aiosync-1-2-ab", 64)])
    hello = LinkSession("engine", peer).hello("t", plane)
    actions = engine.receive(peer, hello, now)
    if peer in engine.sessions:
        actions += engine.plane_opened(peer)
    return [a.message for a in actions if isinstance(a, Reply)]


def test_one_key_holds_at_most_its_share_of_the_sessions() -> None:
    engine = machine(max_sessions=4, max_sessions_per_key=2)
    for peer in ("k1", "k2"):
        assert isinstance(open_session(engine, peer, 0.0)[0], Ready)
    [refused] = open_session(engine, "k3", 0.0)
    assert isinstance(refused, Abort)
    assert "key AAAAAAAA... holds 2 of them (at most 2 each)" in refused.reason
    assert isinstance(open_session(engine, "other", 0.0)[0], Ready)


def test_pings_keep_a_session_but_not_its_slot_once_every_slot_is_wanted() -> None:
    engine = machine(max_sessions=2)
    for peer in ("a", "b"):
        open_session(engine, peer, 0.0)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # pinged all along: alive
        for peer in ("a", "b"):
            engine.receive(peer, Ping(peer), now)
    assert engine.expire(6.0) == []
    [refused] = open_session(engine, "c", 4.0)  # not idle for session_timeout yet
    assert isinstance(refused, Abort)
    assert "2 sessions are open" in refused.reason
    replies = open_session(engine, "c", 6.0)
    assert isinstance(replies[0], Abort)  # the idle one is told why it goes
    assert "session closed: no version for 6s" in replies[0].reason
    assert isinstance(replies[-1], Ready)
    assert set(engine.sessions) == {"b", "c"}


def test_the_kept_manifest_goes_with_the_last_stream_holding_it() -> None:
    memo = ManifestMemo()
    manifest = [TensorMeta(f"t{i}", "float32", (1,)) for i in range(10)]
    begin = memo.decode(encode(Begin(1, manifest)))
    assert isinstance(begin, Begin)
    assert begin.manifest is not None
    memo.settle(begin.manifest)
    assert memo.kept == (len(msgspec.msgpack.encode(manifest)), begin.manifest)
    memo.keep_only([begin.manifest])  # its stream is open
    assert memo.kept[1] is begin.manifest
    memo.keep_only([])  # abandoned: nothing holds it
    assert memo.kept[1] is None


# --------------------------------------------------------------------------------------
# session slots on a live engine
# --------------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path | bytes]:
    made: dict[str, Path | bytes] = {}
    for name in ("server", "attacker", "trainer"):
        public, secret = generate_keypair(tmp_path / name, name)
        made[name], made[f"{name}_secret"] = load_public_key(public), secret
        made[f"{name}_public"] = public
    return made


def client(keys: dict[str, Path | bytes], who: str) -> ChannelAuth:
    secret, server = keys[f"{who}_secret"], keys["server_public"]
    assert isinstance(secret, Path)
    assert isinstance(server, Path)
    return ChannelAuth.client(secret, server)


def server_auth(keys: dict[str, Path | bytes]) -> ChannelAuth:
    secret = keys["server_secret"]
    assert isinstance(secret, Path)
    allowed = [keys["attacker"], keys["trainer"]]
    return ChannelAuth.server(secret, [k for k in allowed if isinstance(k, bytes)])


async def test_one_key_cannot_take_every_session_from_a_trainer(
    keys: dict[str, Path | bytes],
) -> None:
    limits = Limits(max_sessions=4, max_sessions_per_key=2)
    sink = CallbackSink(lambda pairs: None)
    config = ReceiverConfig(limits=limits)
    async with WeightReceiver(
        sink, "tcp://127.0.0.1:0", config=config, auth=server_auth(keys)
    ) as r:
        attackers = [Raw.connect(r.endpoint, client(keys, "attacker")) for _ in range(4)]
        try:
            answers = [await a.hello() for a in attackers]
            assert [isinstance(a, Ready) for a in answers] == [True, True, False, False]
            refused = answers[-1]
            assert isinstance(refused, Abort)
            assert "holds 2 of them (at most 2 each)" in refused.reason
            await commits(r.endpoint, 1, client(keys, "trainer"))  # while the attack holds
            assert r.current_version == 1
            assert r.sessions == 2
        finally:
            for attacker in attackers:
                await attacker.close()


async def test_pinging_sessions_on_ipc_yield_their_slots_once_idle() -> None:
    """On ipc every connection is its own holder: what frees a slot is idleness."""
    config = ReceiverConfig(session_timeout=1.0, limits=Limits(max_sessions=3))
    async with (
        WeightReceiver(CallbackSink(lambda pairs: None), config=config) as receiver,
        anyio.create_task_group() as tg,
    ):
        attackers = [Raw.connect(receiver.endpoint) for _ in range(3)]
        for attacker in attackers:
            assert isinstance(await attacker.hello(), Ready)

        async def keep_pinging() -> None:
            while True:
                for attacker in attackers:
                    await attacker.ping()
                await anyio.sleep(0.1)

        tg.start_soon(keep_pinging)
        late = Raw.connect(receiver.endpoint)
        refused = await late.hello()
        assert isinstance(refused, Abort)
        assert "3 sessions are open" in refused.reason
        await late.close()
        await anyio.sleep(1.2)  # pinged all along, but no version for session_timeout
        await commits(receiver.endpoint, 1)
        assert receiver.current_version == 1
        told = [decode(await a.channel.recv()) for a in attackers[:1]]
        assert isinstance(told[0], Abort)
        assert "session closed: no version" in told[0].reason
        tg.cancel_scope.cancel()
    for attacker in attackers:
        await attacker.close()


# --------------------------------------------------------------------------------------
# frames queued while the engine applies
# --------------------------------------------------------------------------------------


async def test_frames_queued_while_the_engine_applies_are_bounded_by_bytes_per_peer() -> None:
    most = 8 << 20
    frame = b"\x00" * (most - 4096)
    entered, release = threading.Event(), threading.Event()

    def load(pairs: object) -> None:
        entered.set()
        release.wait(WAIT)

    config = ReceiverConfig(limits=Limits(max_message_bytes=most))
    async with (
        WeightReceiver(CallbackSink(load), config=config) as receiver,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(commits, receiver.endpoint, 1)  # its first bucket holds the loop
        with anyio.fail_after(WAIT):
            while not entered.is_set():
                await anyio.sleep(0.01)
        floods = [ZmqChannel.connect(receiver.endpoint) for _ in range(2)]
        tracemalloc.start()  # what Python objects hold (each received frame is one)
        try:
            for _ in range(20):  # 40 frames of nearly 8 MiB
                for flood in floods:
                    await flood.send(frame)
            with anyio.fail_after(WAIT):  # two frames of each are held, the rest dropped
                while receiver.holding.queued_bytes < 2 * 2 * len(frame):
                    await anyio.sleep(0.01)
            await anyio.sleep(0.5)  # the rest have arrived meanwhile
            assert receiver.holding.queued_bytes <= 2 * 2 * most
            grown, _ = tracemalloc.get_traced_memory()  # and the one the listener just read
            assert grown <= 2 * 2 * most + most + (4 << 20), f"{grown >> 20} MiB"
            release.set()
            with anyio.fail_after(WAIT):
                while receiver.current_version != 1:  # the trainer still completes
                    await anyio.sleep(0.01)
        finally:
            tracemalloc.stop()
            release.set()
            for flood in floods:
                await flood.aclose()


# --------------------------------------------------------------------------------------
# abandoned begins
# --------------------------------------------------------------------------------------


async def test_an_abandoned_begin_lets_go_of_its_manifest_at_the_stream_timeout() -> None:
    entries = 20_000
    manifest = [TensorMeta(f"layer.{i}.weight", "float32", (4, 4)) for i in range(entries)]
    config = ReceiverConfig(stream_timeout=0.5)
    async with WeightReceiver(CallbackSink(lambda pairs: None), config=config) as receiver:
        for attempt in range(5):
            attacker = Raw.connect(receiver.endpoint)
            try:
                assert isinstance(await attacker.hello(), Ready)
                ack = await attacker.ask(Begin(attempt + 1, manifest))
                assert isinstance(ack, Ack)
                assert ack.ok, ack
                assert receiver.holding.manifest_entries == entries
                with anyio.fail_after(WAIT):  # it pings, yet its stream makes no progress
                    while receiver.holding.manifest_entries:
                        await attacker.ping()
                        await anyio.sleep(0.05)
                assert receiver.holding.memo_bytes == 0
            finally:
                await attacker.close()
        await commits(receiver.endpoint, 10)
        assert receiver.current_version == 10
        assert receiver.holding.manifest_entries == len(MODEL)  # the trainer's, remembered


# --------------------------------------------------------------------------------------
# segments that claim bytes they never reserved
# --------------------------------------------------------------------------------------


@contextmanager
def sparse_memfd(size: int) -> Iterator[ShmHandle]:
    """A sealed memfd that was only sized: every byte a hole."""
    token, ns, pid = secrets.token_hex(8), pid_namespace(), os.getpid()
    fd = os.memfd_create(f"aiosync-{ns}-{pid}-{token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        yield ShmHandle(f"aiosync-memfd-{ns}-{pid}-{fd}-{token}", size)
    finally:
        os.close(fd)


@contextmanager
def sparse_file(size: int) -> Iterator[ShmHandle]:
    """A file in /dev/shm that was only sized."""
    name = f"aiosync-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        yield ShmHandle(name, size)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("make", [sparse_memfd, sparse_file], ids=["memfd", "file"])
async def test_a_sparse_segment_is_refused_before_the_engine_reads_a_byte(make: object) -> None:
    async with WeightReceiver(CallbackSink(lambda pairs: None)) as receiver:
        with make(1 << 30) as handle:  # type: ignore[operator]
            attacker = Raw.connect(receiver.endpoint)
            try:
                refused = await attacker.hello(ShmPlaneSpec([handle]))
            finally:
                await attacker.close()
        assert isinstance(refused, Abort)
        assert "a sparse segment" in refused.reason
        assert receiver.sessions == 0
        await commits(receiver.endpoint, 1)
        assert receiver.current_version == 1


def test_a_file_emptied_and_resized_after_the_check_is_refused_at_the_next_read() -> None:
    from aiosync.core.errors import AiosyncError
    from aiosync.planes.shm import ShmReceiverPlane, ShmSegment

    segment = ShmSegment.create(1 << 20, backend="file")
    try:
        plane = ShmReceiverPlane(ShmPlaneSpec([segment.handle]))
        assert int(plane.view(0, 1 << 20).sum()) == 0
        path = Path("/dev/shm") / segment.name
        os.truncate(path, 0)
        os.truncate(path, 1 << 20)  # the same size, and every byte a hole again
        with pytest.raises(AiosyncError, match="a sparse segment"):
            plane.view(0, 1 << 20)
        plane.close()
    finally:
        segment.close()


# --------------------------------------------------------------------------------------
# the server: control channels and subscriber slots
# --------------------------------------------------------------------------------------


async def test_one_key_holds_at_most_half_the_servers_control_channels(
    keys: dict[str, Path | bytes],
) -> None:
    auth = server_auth(keys)
    config = ServerConfig(
        publish_endpoint="tcp://127.0.0.1:0",
        control_endpoint="tcp://127.0.0.1:0",
        auth=auth,
        subscriber_auth=ChannelAuth(auth.public_key, auth.secret_key),
        max_subscribers=2,  # 8 control channels in all, 4 per key
        timeout=WAIT,
    )
    async with WeightServer(config) as server:
        attackers = [
            ZmqChannel.connect(server.control_endpoint, auth=client(keys, "attacker"))
            for _ in range(6)
        ]
        try:
            answers = []
            for channel in attackers:
                await channel.send(m.encode(m.StatusRequest()))
                with anyio.fail_after(WAIT):
                    answers.append(m.decode_reply(await channel.recv()))
            assert [isinstance(a, m.Status) for a in answers] == [True] * 4 + [False] * 2
            refused = answers[-1]
            assert isinstance(refused, m.Refused)
            assert "holds 4 of them (at most 4 each)" in refused.reason
            held = empty()
            trainer = client(keys, "trainer")
            async with (
                WeightSender(server.publish_endpoint, config=SMALL, auth=trainer) as sender,
                Subscriber(server.control_endpoint, ModuleSink(held), name="e", auth=trainer) as s,
            ):
                await sender.send(model(3), version=3)
                assert await s.wait_for_version(3, WAIT) == 3
                assert same(held, model(3))
        finally:
            for channel in attackers:
                await channel.aclose()


async def _fake_subscription(control_endpoint: str, name: str) -> m.Reply:
    """Subscribe a receiver that proves it is ours and then never answers a hello."""
    fake = ZmqListener.open()
    control = ZmqChannel.connect(control_endpoint)
    try:
        await control.send(m.encode(m.Subscribe(name, fake.endpoint)))
        with anyio.fail_after(WAIT):
            assert isinstance(m.decode_reply(await control.recv()), m.Prove)
            challenge = decode(await (await fake.accept()).recv())
            assert isinstance(challenge, Challenge)
            await control.send(m.encode(m.Proof(challenge.token)))
            return m.decode_reply(await control.recv())
    finally:
        await control.aclose()
        await fake.aclose()


async def test_receivers_that_never_answer_a_hello_hold_no_subscriber_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "HELLO_BOUND", 1.0)
    async with WeightServer(ServerConfig(max_subscribers=2, timeout=WAIT)) as server:
        refusals: list[m.Reply] = []

        async def fake(index: int) -> None:
            refusals.append(await _fake_subscription(server.control_endpoint, f"fake-{index}"))

        async with anyio.create_task_group() as tg:  # more of them than there are slots
            for index in range(4):
                tg.start_soon(fake, index)
        assert len(refusals) == 4
        for refused in refusals:
            assert isinstance(refused, m.Refused)
            assert "did not answer a hello within 1s" in refused.reason
        assert server.fleet.subscribers == {}

        dead = [ZmqChannel.connect(server.control_endpoint) for _ in range(4)]
        try:
            for index, channel in enumerate(dead):  # nobody serves these: never proven
                nowhere = f"ipc://{server.control_endpoint[6:]}.{index}.nobody"
                await channel.send(m.encode(m.Subscribe(f"dead-{index}", nowhere)))
                with anyio.fail_after(WAIT):
                    assert isinstance(m.decode_reply(await channel.recv()), m.Prove)
            held = empty()
            async with (  # while those wait, a real subscriber takes a slot and is fed
                WeightSender(server.publish_endpoint, config=SMALL) as sender,
                Subscriber(server.control_endpoint, ModuleSink(held), name="real") as sub,
            ):
                await sender.send(model(5), version=5)
                assert await sub.wait_for_version(5, WAIT) == 5
                assert same(held, model(5))
                assert list(server.fleet.subscribers) == ["real"]
        finally:
            for channel in dead:
                await channel.aclose()
