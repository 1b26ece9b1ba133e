"""The collective rendezvous against other local users and hostile peers (Gloo on CPU).

- On loopback the group meets in a private file that other users cannot open, and the
  trainer listens on no TCP port for it.
- A ``TCPStore`` lists its keys (the token) to anyone, but never an engine's secret; a
  process that takes a rank with a leaked token gets no weights: the trainer refuses the
  group, naming the rank, before any broadcast. Once a group formed its store stops.
- Hellos naming a collective plane with a day-long timeout, at a listener that never
  answers, then goodbyes, leave no group thread and no descriptor behind; a peer's
  timeout is taken at most as long as the engine's own.
- Over NCCL (two GPUs): a TCP rendezvous whose store stops once the group formed.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from aiosync import (
    AiosyncError,
    ModuleSink,
    ReceiverConfig,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)
from aiosync.channels.zmq import ZmqChannel
from aiosync.collectives import ops
from aiosync.collectives.admission import RANK_KEY, claim_rank, prove_rank
from aiosync.collectives.alias_store import AliasStore, rank_alias
from aiosync.collectives.deadline import Deadline
from aiosync.collectives.file_store import STORE_FILE, STORE_PREFIX, open_file_store
from aiosync.collectives.process_group import destroy_side_group, init_process_group
from aiosync.collectives.rank_proofs import (
    Admission,
    encode_verdict,
    engine_row,
    judge,
    new_secret,
    read_verdict,
)
from aiosync.collectives.rendezvous import HeldStore, connect_store, new_token, token_store
from aiosync.collectives.store_dialer import socket_inodes
from aiosync.core.errors import ProtocolError
from aiosync.core.layout import plan_buckets
from aiosync.core.wire import (
    PROTOCOL,
    Ack,
    CollectivePlaneSpec,
    Goodbye,
    Hello,
    Ready,
    decode,
    encode,
)
from aiosync.planes.collective import CollectiveOptions, CollectiveSenderPlane
from aiosync.planes.collective_receiver import CollectiveReceiverPlane, check_spec
from aiosync.private_dirs import pid_namespace
from aiosync.trainer.collective import CollectiveSender
from tests.conftest import requires_two_gpus
from tests.helpers.models import mixed_weights

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])
GUARD = 60.0  # seconds: a hang guard only, never a measured bound
DAY_MS = 24 * 3600 * 1000
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def gloo_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32), "b": torch.full((64,), 7.0)}


def listening_ports() -> set[int]:
    """TCP ports this process listens on (from /proc/net, by socket inode)."""
    mine = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def as_other_user(action: str, path: str) -> int:
    """Exit status of a forked child that drops to uid/gid 65534 and tries ``action``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            if action == "list":
                os.listdir(path)
            else:
                os.close(os.open(path, os.O_RDONLY))
        except PermissionError:
            code = 13
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def plane_of(sender: WeightSender) -> CollectiveSenderPlane:
    """The sender's plane (its spec carries no secret; the test reads it as a scan would)."""
    plane = sender._plane
    assert isinstance(plane, CollectiveSenderPlane)
    return plane


def receive(plane: CollectiveReceiverPlane, used: int) -> torch.Tensor:
    return plane.view(0, used).clone()


# --- one host: a private file --------------------------------------------------------


@only_asyncio
async def test_a_loopback_group_meets_in_a_private_file_that_other_users_cannot_open() -> None:
    before = listening_ports()
    plane = CollectiveSenderPlane(CPU, 1, 64 * 1024, CollectiveOptions(engines=1, timeout=20))
    engine: CollectiveReceiverPlane | None = None
    try:
        spec, _ = plane.spec_for_link()
        assert spec.port == 0
        assert spec.store_path
        assert listening_ports() <= before  # no TCP port for the rendezvous
        path = Path(spec.store_path)
        directory = path.parent
        assert directory.name.startswith(STORE_PREFIX)
        for where, mode in ((directory, 0o700), (path, 0o600)):
            info = where.lstat()
            assert info.st_uid == os.geteuid()
            assert stat.S_IMODE(info.st_mode) == mode
        if os.geteuid() == 0:  # root can be another user for a moment
            assert as_other_user("list", str(directory)) == 13
            assert as_other_user("open", str(path)) == 13
        assert spec.secret not in path.read_bytes().decode("latin-1")

        engine = CollectiveReceiverPlane(spec, CPU)
        plan = next(plan_buckets(weights().items(), plane.capacity))
        plane.pack(0, plan)
        await plane.publish(0, plan.used)
        got = await anyio.to_thread.run_sync(receive, engine, plan.used)
        sent = torch.cat([t.view(torch.uint8) for t in weights().values()])
        assert torch.equal(got[: sent.numel()], sent)
        assert spec.secret not in path.read_bytes().decode("latin-1")  # never in the store
    finally:
        if engine is not None:
            engine.close()
        plane.close()
    assert not directory.exists()  # the trainer removes its directory


def store_dir(tmp_path: Path, mode: int = 0o700) -> Path:
    directory = tmp_path / f"{STORE_PREFIX}{pid_namespace()}-{os.getpid()}-abcdefgh"
    directory.mkdir(mode=mode)
    directory.chmod(mode)
    return directory


def test_an_engine_checks_the_rendezvous_path_before_opening_it(tmp_path: Path) -> None:
    wait = timedelta(seconds=1)
    good = store_dir(tmp_path)
    missing = good / STORE_FILE
    with pytest.raises(ProtocolError, match="is not on this host"):
        open_file_store(str(missing), wait)
    with pytest.raises(ProtocolError, match="does not name"):
        open_file_store(str(tmp_path / "elsewhere" / STORE_FILE), wait)
    with pytest.raises(ProtocolError, match="does not name"):
        open_file_store(str(good / "bashrc"), wait)
    with pytest.raises(ProtocolError, match="not absolute"):
        open_file_store(f"{good}/../{good.name}/{STORE_FILE}", wait)
    target = tmp_path / "target"
    target.write_bytes(b"")
    missing.symlink_to(target)
    with pytest.raises(ProtocolError, match="symlink"):
        open_file_store(str(missing), wait)
    missing.unlink()
    missing.write_bytes(b"")
    missing.chmod(0o644)
    with pytest.raises(ProtocolError, match="open to other users"):
        open_file_store(str(missing), wait)
    missing.chmod(0o600)
    os.link(missing, tmp_path / "second")
    with pytest.raises(ProtocolError, match="2 links"):
        open_file_store(str(missing), wait)
    os.unlink(tmp_path / "second")
    good.chmod(0o755)
    with pytest.raises(ProtocolError, match="open to other users"):
        open_file_store(str(missing), wait)
    good.chmod(0o700)
    open_file_store(str(missing), wait)  # all is well


def test_a_spec_without_a_secret_or_with_a_port_beside_a_file_is_refused() -> None:
    spec = CollectivePlaneSpec(
        "gloo", "127.0.0.1", 0, new_token(), "g", 2, 1, 4096, secret=new_secret(),
        store_path=f"/tmp/{STORE_PREFIX}1-2-abcdefgh/{STORE_FILE}",
    )  # fmt: skip
    check_spec(spec)
    with pytest.raises(ProtocolError, match="rank secret"):
        check_spec(msgspec.structs.replace(spec, secret=""))
    with pytest.raises(ProtocolError, match="beside a rendezvous file"):
        check_spec(msgspec.structs.replace(spec, port=1234))


# --- proofs (pure) -------------------------------------------------------------------


def test_a_rank_proves_only_its_own_secret_at_its_own_rank_in_its_own_group() -> None:
    group, token = "aiosync-g", new_token()
    first, second = new_secret(), new_secret()
    rows = [bytes(48), engine_row(first, group, token, 1), engine_row(second, group, token, 2)]
    assert judge(rows, [first, second], group, token) == Admission({1: first, 2: second}, ())
    replayed = [bytes(48), engine_row(first, group, token, 1), engine_row(first, group, token, 1)]
    assert judge(replayed, [first, second], group, token).refused == (2,)  # another rank's row
    reused = [bytes(48), engine_row(first, group, token, 1), engine_row(first, group, token, 2)]
    assert judge(reused, [first, second], group, token).refused == (2,)  # one rank per secret
    elsewhere = [bytes(48), engine_row(first, "aiosync-h", token, 1)]
    assert judge(elsewhere, [first], group, token).refused == (1,)
    forged = [bytes(48), engine_row(new_secret(), group, token, 1)]
    assert judge(forged, [first], group, token).refused == (1,)


def test_an_engine_refuses_a_rank_0_that_cannot_prove_it_greeted_it() -> None:
    group, token, secret = "aiosync-g", new_token(), new_secret()
    good = encode_verdict(Admission({1: secret}, ()), 2, group, token)
    read_verdict(good, secret, group, token, 1)
    impostor = encode_verdict(Admission({1: new_secret()}, ()), 2, group, token)
    with pytest.raises(ProtocolError, match="rank 0 did not prove"):
        read_verdict(impostor, secret, group, token, 1)
    refused = encode_verdict(Admission({1: secret}, (2,)), 3, group, token)
    with pytest.raises(ProtocolError, match="rank 2 proved no engine session's secret"):
        read_verdict(refused, secret, group, token, 1)


# --- a TCPStore: its keys are readable, its ranks are proved ---------------------------


def keys_of(client: TCPStore, wanted: str) -> tuple[list[str], str, str]:
    """Poll the store's keys until an aiosync key shows ``wanted`` ("token" or "group")."""
    while True:
        keys = client.list_keys()
        for key in keys:
            parts = [part for part in key.split("/") if part]
            if parts[0] != "aiosync":
                continue
            if wanted == "token" or parts[2] != RANK_KEY:
                return keys, parts[1], parts[2]
        threading.Event().wait(0.01)


def intrude(host: str, port: int, world: int, seen: dict[str, object]) -> None:
    """What another user can do with a port: list the keys, take a rank with the token."""
    client = connect_store(host, port, timeout=timedelta(seconds=20))
    keys, token, _ = keys_of(client, "token")  # once the first engine took its rank
    store = token_store(client, token)
    rank = claim_rank(store, world, "the group")
    seen["rank"] = rank
    keys, _, group = keys_of(client, "group")  # once every rank was taken
    seen["keys"], seen["values"] = keys, [client.get(key) for key in keys]
    alias = rank_alias(group, rank)
    held = HeldStore(AliasStore(store, alias, group))
    pg = init_process_group(
        "gloo", store=held, world_size=world, rank=rank, group_name=alias,
        timeout=timedelta(seconds=20),
    )  # fmt: skip
    try:
        try:
            prove_rank(pg, CPU, rank, world, new_secret(), (group, token), Deadline.after(20))
        except ProtocolError as exc:
            seen["verdict"] = str(exc)
        got = torch.zeros(4096, dtype=torch.uint8)
        try:
            ops.broadcast(pg, got, 0, Deadline.after(2))
            seen["broadcast"] = "received"
        except Exception as exc:
            seen["broadcast"] = str(exc)
        seen["bytes"] = got
    finally:
        held.release()
        destroy_side_group(pg)


@only_asyncio
async def test_a_rank_taken_with_a_leaked_token_gets_no_weights_and_is_named() -> None:
    options = CollectiveOptions(engines=2, timeout=20, rendezvous="tcp")
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=20)
    async with (
        WeightReceiver(ModuleSink(weights())) as first,
        WeightReceiver(ModuleSink(weights())) as second,
        CollectiveSender((), collective=options, config=config) as sender,
    ):
        public = plane_of(sender).spec  # what a port scan finds: an address (no secret)
        assert public.store_path == ""
        assert public.secret == ""
        await sender.add_engine(first.endpoint)  # rank 1; its secret travels in its hello
        seen: dict[str, object] = {}
        args = (public.host, public.port, 3, seen)
        intruder = threading.Thread(target=intrude, args=args, daemon=True)
        intruder.start()
        with anyio.fail_after(GUARD):
            while "rank" not in seen and intruder.is_alive():
                await anyio.sleep(0.01)
        assert seen["rank"] == 2  # before the second engine's hello: it finds the group full
        await sender.add_engine(second.endpoint)
        with anyio.fail_after(GUARD), pytest.raises(AiosyncError) as caught:
            await sender.send(weights(), version=0)
        assert "rank 2 proved no engine session's secret" in str(caught.value)
        await anyio.to_thread.run_sync(intruder.join, GUARD)
        assert "refused the group before any broadcast" in str(seen["verdict"])
        assert seen["broadcast"] != "received"
        assert not torch.any(seen["bytes"])  # type: ignore[call-overload]
        secrets = plane_of(sender)._meeting._secrets  # handed to the engines' sessions
        assert len(secrets) == 2
        keys, values = seen["keys"], seen["values"]
        assert isinstance(keys, list)
        assert isinstance(values, list)
        assert any(public.token in key for key in keys)  # the token is no secret...
        for text in [*keys, *(bytes(value).decode("latin-1") for value in values)]:
            assert all(secret not in text for secret in secrets)  # ...the secrets never go there


@only_asyncio
async def test_a_tcp_store_stops_once_its_group_formed() -> None:
    options = CollectiveOptions(engines=1, timeout=20, rendezvous="tcp")
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=20)
    target = {name: torch.zeros_like(t) for name, t in weights().items()}
    async with (
        WeightReceiver(ModuleSink(target)) as receiver,
        CollectiveSender([receiver.endpoint], collective=options, config=config) as sender,
    ):
        port = plane_of(sender).spec.port
        assert port in listening_ports()
        await sender.send(weights(), version=0)
        assert torch.equal(target["w"], weights()["w"])
        with anyio.fail_after(GUARD):
            while port in listening_ports():  # nobody can write to it any more
                await anyio.sleep(0.01)


# --- hellos and goodbyes: nothing left behind ----------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listener that never accepts nor answers (torch's store client would wait forever)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        yield listener.getsockname()[1]


def silent_spec(port: int) -> CollectivePlaneSpec:
    return CollectivePlaneSpec(
        "gloo", "127.0.0.1", port, new_token(), f"aiosync-{uuid.uuid4().hex}", 2, 1, 4096,
        timeout_ms=DAY_MS, secret=new_secret(),
    )  # fmt: skip


def group_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiosync-")]


def sockets_to(port: int) -> int:
    """This process's sockets connected to ``port``."""
    count = 0
    for inode, fd in socket_inodes().items():
        try:
            copy = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(copy).st_ino != inode:
                continue
            with socket.socket(fileno=copy) as sock:
                copy = -1
                peer = sock.getpeername()
            count += isinstance(peer, tuple) and peer[1] == port
        except OSError:
            continue
        finally:
            if copy >= 0:
                os.close(copy)
    return count


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def hello_then_goodbye(endpoint: str, spec: CollectivePlaneSpec) -> None:
    channel = ZmqChannel.connect(endpoint)
    try:
        session = uuid.uuid4().hex
        with anyio.fail_after(GUARD):
            await channel.send(encode(Hello(PROTOCOL, PROTOCOL, session, "hostile", spec)))
            assert isinstance(decode(await channel.recv()), Ready)
            await channel.send(encode(Goodbye(session)))
            assert isinstance(decode(await channel.recv()), Ack)
    finally:
        await channel.aclose()


@only_asyncio
async def test_forty_hellos_then_goodbyes_leave_no_thread_or_descriptor_behind(
    silent_port: int,
) -> None:
    config = ReceiverConfig(stream_timeout=5, session_timeout=5)
    async with WeightReceiver(ModuleSink({}), config=config) as receiver:
        await hello_then_goodbye(receiver.endpoint, silent_spec(silent_port))  # warm up
        with anyio.fail_after(GUARD):
            while group_threads() or sockets_to(silent_port):
                await anyio.sleep(0.05)
        threads, fds = len(threading.enumerate()), descriptors()
        for _ in range(40):
            await hello_then_goodbye(receiver.endpoint, silent_spec(silent_port))
        with anyio.fail_after(GUARD):  # each goodbye cut its connection: no day-long wait
            while group_threads() or sockets_to(silent_port) or descriptors() > fds:
                await anyio.sleep(0.05)
        assert len(threading.enumerate()) <= threads + 4  # anyio's idle workers at most
        assert receiver.sessions == 0


def test_a_peers_timeout_is_capped_by_the_engines_own(silent_port: int) -> None:
    plane = CollectiveReceiverPlane(silent_spec(silent_port), CPU, max_timeout=0.5)
    try:
        with pytest.raises(AiosyncError, match=r"within the 0\.5s deadline"):
            plane.view(0, 64)
        deadline = Deadline.after(GUARD)
        while sockets_to(silent_port) and not deadline.expired:  # cut at the engine's cap
            threading.Event().wait(0.05)
        assert sockets_to(silent_port) == 0
    finally:
        plane.close()


# --- over NCCL (two GPUs) ----------------------------------------------------------------


@pytest.mark.multigpu
@requires_two_gpus
@only_asyncio
async def test_nccl_over_a_tcp_rendezvous_whose_store_stops_once_the_group_formed() -> None:
    from tests.processes.test_collectives_plane import digests, engines

    def on_gpu0(seed: int) -> dict[str, torch.Tensor]:
        return {name: t.to("cuda:0") for name, t in mixed_weights(seed=seed).items()}

    options = CollectiveOptions(engines=1, timeout=60, rendezvous="tcp")
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=60)
    with engines(["--device", "cuda:1"]) as (engine,):
        async with CollectiveSender(
            [engine.endpoint], collective=options, device="cuda:0", config=config
        ) as sender:
            port = plane_of(sender).spec.port
            await sender.send(on_gpu0(1), version=0)
            with anyio.fail_after(GUARD):
                while port in listening_ports():
                    await anyio.sleep(0.01)
            await anyio.sleep(3)  # NCCL's watchdog looks at the released store meanwhile
            await sender.send(on_gpu0(2), version=1)  # the same group, its store gone
        for version, seed in ((0, 1), (1, 2)):
            committed = await engine.until("committed")
            assert (committed["version"], committed["digests"]) == (version, digests(seed))
