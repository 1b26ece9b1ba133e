"""The server's roles (issue 26.2): a subscription proves it owns the receiver it names,
publishers and subscribers are separate keys, and a keyed tcp server feeds a subscriber
whose receiver is on the default private ipc:// endpoint."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender
from aiosync.channels.keys import ChannelAuth, generate_keypair, load_public_key
from aiosync.channels.zmq import ZmqChannel
from aiosync.core.errors import AiosyncError, RejectedError
from aiosync.server import ServerClient, ServerConfig, Subscriber, WeightServer
from aiosync.server import messages as m
from aiosync.server.roles import Roles, receiver_auth, role_auth
from tests.api.test_server import SMALL, empty, model, same

WAIT = 30.0


@dataclass(frozen=True)
class Keys:
    """A server's, a trainer's and an engine's keypairs, as files and public keys."""

    server_pub: Path
    server_sec: Path
    trainer_sec: Path
    engine_sec: Path
    trainer: bytes
    engine: bytes

    def server(self) -> ChannelAuth:
        return ChannelAuth.server(self.server_sec, [])

    def client(self, secret: Path) -> ChannelAuth:
        return ChannelAuth.client(secret, self.server_pub)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    server_pub, server_sec = generate_keypair(tmp_path / "server", "server")
    trainer_pub, trainer_sec = generate_keypair(tmp_path / "trainer", "trainer")
    engine_pub, engine_sec = generate_keypair(tmp_path / "engine", "engine")
    return Keys(
        server_pub,
        server_sec,
        trainer_sec,
        engine_sec,
        load_public_key(trainer_pub),
        load_public_key(engine_pub),
    )


def separated(keys: Keys) -> ServerConfig:
    """A tcp server with CURVE whose trainer key publishes and engine key subscribes."""
    auth = keys.server()
    return ServerConfig(
        publish_endpoint="tcp://127.0.0.1:0",
        control_endpoint="tcp://127.0.0.1:0",
        auth=auth,
        publisher_keys=[keys.trainer],
        subscriber_keys=[keys.engine],
        subscriber_auth=ChannelAuth(auth.public_key, auth.secret_key),
        timeout=WAIT,
    )


async def test_naming_another_engines_receiver_is_refused_and_that_engine_never_moves() -> None:
    async with (
        WeightServer(ServerConfig(timeout=WAIT)) as server,
        WeightSender(server.publish_endpoint, config=SMALL) as sender,
    ):
        await sender.send(model(7), version=7)
        weights = empty()
        async with WeightReceiver(ModuleSink(weights)) as victim:  # never subscribed
            async with ServerClient(server.control_endpoint, timeout=WAIT) as client:
                reply = await client.ask(m.Subscribe("intruder", victim.endpoint))
                assert isinstance(reply, m.Prove)
                with anyio.fail_after(WAIT):  # the challenge reached the victim, and stays there
                    while victim.challenges.token(reply.ref) is None:
                        await anyio.sleep(0.01)
                with pytest.raises(RejectedError, match="does not match"):
                    await client.request(m.Proof(b"\x00" * 32))
            async with ServerClient(server.control_endpoint, timeout=WAIT) as client:
                reply = await client.ask(m.Subscribe("intruder", victim.endpoint))
                assert isinstance(reply, m.Prove)
                with pytest.raises(RejectedError, match="expected its proof"):
                    await client.request(m.StatusRequest())
                assert (await client.status()).engines == []  # nobody was ever counted
            await anyio.sleep(0.3)  # time for anything that would go to the victim
            assert victim.current_version is None
            assert victim.sessions == 0
            assert victim.failures == []
            assert same(weights, empty())

            mine = empty()  # its own subscriber still proves and is fed (another receiver)
            async with Subscriber(server.control_endpoint, ModuleSink(mine), name="own") as sub:
                assert await sub.wait_for_version(7, WAIT) == 7
                assert same(mine, model(7))
            assert victim.current_version is None


async def test_a_client_that_never_proves_is_refused_after_the_timeout() -> None:
    async with (
        WeightServer(ServerConfig(timeout=0.3)) as server,
        WeightReceiver(ModuleSink(empty())) as victim,
    ):
        channel = ZmqChannel.connect(server.control_endpoint)
        try:
            await channel.send(m.encode(m.Subscribe("x", victim.endpoint)))
            with anyio.fail_after(WAIT):
                assert isinstance(m.decode_reply(await channel.recv()), m.Prove)
                refused = m.decode_reply(await channel.recv())  # unasked, once it gave up
        finally:
            await channel.aclose()
        assert isinstance(refused, m.Refused)
        assert "did not arrive within 0.3s" in refused.reason
        assert server.fleet.subscribers == {}
        assert victim.current_version is None


async def test_a_subscriber_key_cannot_publish(keys: Keys) -> None:
    async with WeightServer(separated(keys)) as server:
        with pytest.raises(AiosyncError, match="does not allow"):  # refused in the handshake
            async with WeightSender(
                server.publish_endpoint,
                config=SenderConfig(timeout=5),
                auth=keys.client(keys.engine_sec),
            ) as intruder:
                await intruder.send(model(9), version=9)
        async with WeightSender(
            server.publish_endpoint, config=SMALL, auth=keys.client(keys.trainer_sec)
        ) as sender:
            await sender.send(model(1), version=1)
        assert server.store.versions == [1]


async def test_a_publisher_key_cannot_subscribe_but_may_ask_for_status(keys: Keys) -> None:
    async with WeightServer(separated(keys)) as server:
        trainer = keys.client(keys.trainer_sec)
        async with (
            WeightSender(server.publish_endpoint, config=SMALL, auth=trainer) as sender,
            ServerClient(server.control_endpoint, auth=trainer, timeout=WAIT) as client,
        ):
            await sender.send(model(2), version=2)
            assert (await client.status()).newest == 2  # back-pressure: status and wait
            await client.wait_within_bounds(WAIT)
            async with WeightReceiver(ModuleSink(empty())) as receiver:
                with pytest.raises(RejectedError, match="publisher's key"):
                    await client.ask(m.Subscribe("trainer", receiver.endpoint))
                for request in (m.Pull(None, 1.0), m.Get(2, 0, 0, 1), m.Follow()):
                    with pytest.raises(RejectedError, match="publisher's key"):
                        await client.request(request)
                assert len(receiver.challenges) == 0  # refused before anything went there
                assert receiver.current_version is None
            with pytest.raises(RejectedError, match="publisher's key"):
                async with Subscriber(
                    server.control_endpoint, ModuleSink(empty()), name="t", auth=trainer
                ):
                    pass
            assert (await client.status()).engines == []


async def test_a_keyed_tcp_server_feeds_a_subscriber_on_the_default_ipc_endpoint(
    keys: Keys,
) -> None:
    async with WeightServer(separated(keys)) as server:
        held = empty()
        async with (
            WeightSender(
                server.publish_endpoint, config=SMALL, auth=keys.client(keys.trainer_sec)
            ) as sender,
            Subscriber(
                server.control_endpoint,
                ModuleSink(held),
                name="ipc-engine",
                auth=keys.client(keys.engine_sec),
            ) as sub,
        ):
            assert sub.endpoint.startswith("ipc://")
            for version in (3, 4):
                await sender.send(model(version), version=version)
                assert await sub.wait_for_version(version, WAIT) == version
                assert same(held, model(version))


async def test_one_key_list_still_holds_both_roles_and_says_so(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    auth = ChannelAuth.server(keys.server_sec, [keys.trainer, keys.engine])
    config = ServerConfig(
        control_endpoint="tcp://127.0.0.1:0",
        auth=auth,
        subscriber_auth=ChannelAuth(auth.public_key, auth.secret_key),
        timeout=WAIT,
    )
    trainer = keys.client(keys.trainer_sec)
    with caplog.at_level(logging.WARNING, logger="aiosync.server.server"):
        async with (
            WeightServer(config) as server,
            WeightReceiver(ModuleSink(empty())) as receiver,
            ServerClient(server.control_endpoint, auth=trainer, timeout=WAIT) as client,
        ):
            reply = await client.ask(m.Subscribe("either", receiver.endpoint))
            assert isinstance(reply, m.Prove)  # a shared key may subscribe
    assert "may both publish and subscribe" in caplog.text


def test_role_keys_are_checked_when_configured(keys: Keys) -> None:
    auth = keys.server()
    with pytest.raises(ValueError, match="each key holds one role"):
        ServerConfig(auth=auth, publisher_keys=[keys.trainer], subscriber_keys=[keys.trainer])
    with pytest.raises(ValueError, match="server's keypair"):
        ServerConfig(publisher_keys=[keys.trainer])
    with pytest.raises(ValueError, match="not a CURVE key"):
        ServerConfig(auth=auth, publisher_keys=[b"short"])
    both = ChannelAuth.server(keys.server_sec, [keys.trainer, keys.engine])
    with pytest.raises(ValueError, match="each key holds one role"):  # the other falls back
        ServerConfig(auth=both, publisher_keys=[keys.trainer])
    split = role_auth(auth, [keys.trainer], [keys.engine])
    assert split.publish is not None
    assert split.publish.allowed_clients == {keys.trainer}
    assert split.control is not None
    assert split.control.allowed_clients == {keys.trainer, keys.engine}
    assert not split.shared
    assert role_auth(both, None, None).shared


def test_who_may_make_which_request(keys: Keys) -> None:
    roles = Roles(frozenset([keys.trainer]), frozenset([keys.engine]))
    subscribe = m.Subscribe("e", "ipc:///x")
    assert roles.refusal(subscribe, keys.engine) is None
    assert "publisher's key" in (roles.refusal(subscribe, keys.trainer) or "")
    assert "not a subscriber's key" in (roles.refusal(m.Fetch(1), b"k" * 40) or "")
    assert roles.refusal(m.StatusRequest(), keys.trainer) is None
    assert roles.refusal(m.Wait(1.0), keys.trainer) is None
    assert roles.refusal(subscribe, None) is None  # no CURVE on the control endpoint
    assert Roles().refusal(subscribe, keys.trainer) is None  # one list: both roles


def test_how_the_server_reaches_a_receiver(keys: Keys) -> None:
    auth = keys.server()
    own = ChannelAuth(auth.public_key, auth.secret_key)
    assert receiver_auth("ipc:///run/e.sock", own, None) is None  # the private directory
    curve = receiver_auth("tcp://127.0.0.1:5", own, keys.engine.decode())
    assert curve is not None
    assert curve.server_key == keys.engine
    ipc_curve = receiver_auth("ipc:///run/e.sock", own, keys.engine.decode())
    assert ipc_curve is not None
    assert ipc_curve.server_key == keys.engine
    with pytest.raises(AiosyncError, match="needs its public key"):
        receiver_auth("tcp://127.0.0.1:5", own, None)
    loopback = ChannelAuth(insecure_loopback=True)
    assert receiver_auth("tcp://127.0.0.1:5", loopback, None) is loopback
    assert receiver_auth("tcp://127.0.0.1:5", None, None) is None


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "aiosync", "serve", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=WAIT)


def test_the_cli_refuses_role_flags_it_cannot_use(tmp_path: Path, keys: Keys) -> None:
    public, _ = generate_keypair(tmp_path, "trainer")
    alone = serve("--allow-publishers", str(public))
    assert alone.returncode == 1
    assert "need --keypair" in alone.stderr
    both = serve(
        "--keypair", str(keys.server_sec),
        "--allow-publishers", str(public),
        "--allow-subscribers", str(public),
    )  # fmt: skip
    assert both.returncode == 1
    assert "each key holds one role" in both.stderr
