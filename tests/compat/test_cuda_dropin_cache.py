"""The drop-in keeps its sender across calls (issue 10, item 3); these run on the CPU."""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq

from aiosync import ModuleSink, ReceiverConfig, WeightReceiver
from aiosync.compat import nemo_rl, stream_cache

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    engine = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    return trainer, engine


async def until(condition: object, what: str) -> None:
    """Poll ``condition()`` on the loop (a hang guard only: receivers expose no event)."""
    with anyio.fail_after(30):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.01)


async def stream(trainer: torch.nn.Module, sock: zmq.Socket[bytes], size: int) -> None:
    await anyio.to_thread.run_sync(
        nemo_rl.stream_weights_via_ipc_zmq_impl, trainer.named_parameters(), size, sock, 1, "p"
    )


@only_asyncio
@pytest.mark.parametrize("kind", [zmq.DEALER, zmq.REQ])
async def test_repeated_calls_reuse_one_sender_until_the_size_changes_or_release(
    kind: int,
) -> None:
    trainer, engine = models()
    async with WeightReceiver(ModuleSink(engine)) as receiver:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(kind)
        sock.connect(receiver.endpoint)
        try:
            await stream(trainer, sock, 8192)
            first = stream_cache._streams[id(sock)]
            for version in (1, 2):
                with torch.no_grad():
                    trainer[0].weight.add_(1)
                await stream(trainer, sock, 8192)
                assert receiver.current_version == version
                assert stream_cache._streams[id(sock)] is first  # no new sender, no new hello
                assert receiver.sessions == 1
                assert torch.equal(trainer[0].weight, engine[0].weight)
            await stream(trainer, sock, 16384)  # another size: a new sender, the old one gone
            assert stream_cache._streams[id(sock)] is not first
            assert not first._thread.is_alive()
            await until(lambda: receiver.sessions == 1, "the old session closed")
            assert nemo_rl.release_ipc_zmq_streams(sock) == 1
            assert id(sock) not in stream_cache._streams
            await until(lambda: receiver.sessions == 0, "goodbye")
            assert nemo_rl.release_ipc_zmq_streams(sock) == 0
        finally:
            nemo_rl.release_ipc_zmq_streams(sock)
            sock.close(linger=0)
            ctx.term()


@only_asyncio
async def test_a_closed_socket_releases_its_sender_and_a_new_socket_gets_a_new_one() -> None:
    trainer, engine = models()
    async with WeightReceiver(ModuleSink(engine)) as receiver:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(receiver.endpoint)
            await stream(trainer, sock, 8192)
            cached = stream_cache._streams[id(sock)]
            sock.close(linger=0)
            with anyio.fail_after(30):  # it notices within IDLE_CHECK seconds
                await anyio.to_thread.run_sync(cached._thread.join)
            other = ctx.socket(zmq.DEALER)
            other.connect(receiver.endpoint)
            try:
                await stream(trainer, other, 8192)
                assert stream_cache._streams[id(other)] is not cached
                assert receiver.current_version == 1
            finally:
                nemo_rl.release_ipc_zmq_streams(other)
                other.close(linger=0)
        finally:
            ctx.term()


@only_asyncio
async def test_a_req_session_the_engine_forgot_is_renewed_transparently() -> None:
    trainer, engine = models()
    config = ReceiverConfig(session_timeout=0.5, stream_timeout=30)
    async with WeightReceiver(ModuleSink(engine), config=config) as receiver:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.REQ)  # cannot send keepalives between calls
        sock.connect(receiver.endpoint)
        try:
            await stream(trainer, sock, 8192)
            await until(lambda: receiver.sessions == 0, "the engine to expire the session")
            with torch.no_grad():
                trainer[1].bias.add_(1)
            await stream(trainer, sock, 8192)
            assert receiver.current_version == 1
            assert torch.equal(trainer[1].bias, engine[1].bias)
        finally:
            nemo_rl.release_ipc_zmq_streams(sock)
            sock.close(linger=0)
            ctx.term()
