"""The server's trust boundary on tcp: CURVE keys for publishers, subscribers and the
server's own connections to subscribers; strangers are refused; per-subscriber bounds."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.channels.keys import ChannelAuth, generate_keypair, load_public_key
from aiosync.core.errors import AiosyncError
from aiosync.server import ServerClient, ServerConfig, Subscriber, WeightServer
from tests.api.test_server import empty, model, same

WAIT = 30.0


async def test_publish_and_subscribe_over_tcp_with_keys(tmp_path: Path) -> None:
    server_pub, server_sec = generate_keypair(tmp_path / "server", "server")
    trainer_pub, trainer_sec = generate_keypair(tmp_path / "trainer", "trainer")
    engine_pub, engine_sec = generate_keypair(tmp_path / "engine", "engine")
    _, stranger_sec = generate_keypair(tmp_path / "stranger", "stranger")
    allowed = [load_public_key(trainer_pub), load_public_key(engine_pub)]
    server_auth = ChannelAuth.server(server_sec, allowed)
    config = ServerConfig(
        publish_endpoint="tcp://127.0.0.1:0",
        control_endpoint="tcp://127.0.0.1:0",
        auth=server_auth,
        subscriber_auth=ChannelAuth(server_auth.public_key, server_auth.secret_key),
        timeout=WAIT,
    )
    async with WeightServer(config) as server:
        held = empty()
        receiver_auth = ChannelAuth.server(engine_sec, [load_public_key(server_pub)])
        async with (
            WeightSender(
                server.publish_endpoint,
                config=SenderConfig(timeout=WAIT),
                auth=ChannelAuth.client(trainer_sec, server_pub),
            ) as sender,
            Subscriber(
                server.control_endpoint,
                ModuleSink(held),
                name="tcp-engine",
                endpoint="tcp://127.0.0.1:0",
                auth=ChannelAuth.client(engine_sec, server_pub),
                receiver_auth=receiver_auth,
            ) as sub,
        ):
            await sender.send(model(5), version=5)
            assert await sub.wait_for_version(5, WAIT) == 5
            assert same(held, model(5))
            stranger = ChannelAuth.client(stranger_sec, server_pub)
            with pytest.raises(AiosyncError, match="does not allow"):  # refused in the handshake
                async with ServerClient(server.control_endpoint, auth=stranger, timeout=5) as c:
                    await c.status()
            with pytest.raises(AiosyncError):
                async with WeightSender(
                    server.publish_endpoint, config=SenderConfig(timeout=5), auth=stranger
                ):
                    pass
            assert server.newest == 5  # nothing a stranger did changed what engines get


async def test_per_subscriber_bounds() -> None:
    config = ServerConfig(max_subscribers=1, timeout=WAIT)
    async with WeightServer(config) as server:
        a, b = empty(), empty()
        async with Subscriber(server.control_endpoint, ModuleSink(a), name="one") as one:
            with pytest.raises(AiosyncError, match="already 1 subscribers"):
                async with Subscriber(server.control_endpoint, ModuleSink(b), name="two"):
                    pass
            with pytest.raises(AiosyncError, match="already subscribed"):
                await one.client.request(
                    __import__("aiosync.server.messages", fromlist=["m"]).Subscribe(
                        "again", one.receiver.endpoint
                    )
                )
            with anyio.fail_after(WAIT):
                assert (await one.client.status()).engines[0].name == "one"
            async with AsyncExitStack() as clients:  # 4 control channels per subscriber
                for _ in range(3):
                    client = await clients.enter_async_context(
                        ServerClient(server.control_endpoint)
                    )
                    await client.status()
                extra = await clients.enter_async_context(ServerClient(server.control_endpoint))
                with pytest.raises(AiosyncError, match="too many control channels"):
                    await extra.status()
            assert (await one.client.status()).engines[0].name == "one"  # unharmed


async def test_a_quiet_client_is_forgotten_and_its_next_request_served() -> None:
    async with (
        WeightServer(ServerConfig(timeout=0.2)) as server,
        ServerClient(server.control_endpoint) as client,
    ):
        await client.status()
        with anyio.fail_after(WAIT):  # a ROUTER never hears a client leave: idle expiry
            while server._controls:
                await anyio.sleep(0.02)
        assert (await client.status()).engines == []  # a new channel, transparently
