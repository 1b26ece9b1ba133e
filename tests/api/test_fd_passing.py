"""Descriptors passed from a trainer to an engine over a UNIX socket (SCM_RIGHTS), on the CPU.

Plain files stand in for CUDA's exported allocations: each "piece" is a file holding its
own number, so an engine that reads what it received knows which descriptors came, in
which order. Server and client run in this process (the server on its thread), so the
tests also count this process's open descriptors: none may be left behind, on either side,
whatever goes wrong.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.plane_specs import DescriptorSource
from aiosync.planes.fd_passing import (
    FDS_PER_MESSAGE,
    MAX_PIECES,
    FdReply,
    FdServer,
    fetch_fds,
    peer_credentials,
)
from aiosync.private_dirs import make_private_dir

pytestmark = pytest.mark.timeout(60)


def open_files() -> int:
    """Descriptors of files (not sockets) this process has open now."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone
            count += not os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
    return count


def quiet(server: FdServer) -> int:
    """The open files once ``server`` is done with every earlier connection.

    It serves one connection at a time and closes what it sent right after sending: once
    it has answered a new connection (here a refusal, which sends nothing), it is.
    """
    wrong = msgspec.structs.replace(server.source, token=b"not the token")
    with pytest.raises(AiosyncError, match="wrong token"):
        collect(wrong, 1, 1)
    return open_files()


class Files:
    """An exporter over plain files: region ``ident`` has ``pieces[ident]`` pieces."""

    def __init__(self, pieces: dict[int, int]) -> None:
        self.pieces = pieces
        self.directory = Path(tempfile.mkdtemp())
        self.exported: list[int] = []
        self.refuse = ""

    def path(self, ident: int, index: int) -> Path:
        return self.directory / f"{ident}-{index}"

    def __call__(self, ident: int, start: int, count: int) -> list[tuple[int, int]]:
        if self.refuse:
            raise AiosyncError(self.refuse)
        if ident not in self.pieces or start + count > self.pieces[ident]:
            raise AiosyncError(f"no pieces {start}+{count} of {ident}")
        out = []
        for index in range(start, start + count):
            path = self.path(ident, index)
            path.write_text(f"{ident}:{index}")
            fd = os.open(path, os.O_RDONLY)
            self.exported.append(fd)
            out.append((fd, 1000 + index))
        return out


def read(fd: int) -> str:
    return os.pread(fd, 64, 0).decode()


def collect(source: DescriptorSource, ident: int, count: int) -> list[tuple[str, int]]:
    """What each descriptor of region ``ident`` reads, and its size (each close-on-exec)."""
    got: list[tuple[str, int]] = []

    def take(batch: list[tuple[int, int]]) -> None:
        assert 0 < len(batch) <= FDS_PER_MESSAGE
        for fd, size in batch:
            assert os.get_inheritable(fd) is False
            got.append((read(fd), size))

    fetch_fds(source, ident, count, take)
    return got


@pytest.fixture
def files() -> Iterator[Files]:
    exporter = Files({1: 3, 2: 150})
    yield exporter
    for path in exporter.directory.iterdir():
        path.unlink()
    exporter.directory.rmdir()


@pytest.fixture
def server(files: Files) -> Iterator[FdServer]:
    serving = FdServer(files)
    serving.start()
    yield serving
    serving.close()


def test_a_region_s_descriptors_arrive_in_order_with_their_sizes(server: FdServer) -> None:
    before = quiet(server)
    got = collect(server.source, 1, 3)
    assert got == [("1:0", 1000), ("1:1", 1001), ("1:2", 1002)]
    assert quiet(server) == before  # each batch closed once taken


def test_more_pieces_than_one_message_holds_come_in_several(server: FdServer) -> None:
    assert FDS_PER_MESSAGE < 150
    got = collect(server.source, 2, 150)
    assert [text for text, _ in got] == [f"2:{i}" for i in range(150)]


def test_the_server_closes_every_descriptor_it_sent(server: FdServer, files: Files) -> None:
    collect(server.source, 1, 3)
    server.close()  # its thread has ended: every answer it sent is behind it
    for fd in files.exported:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)


def test_a_batch_the_caller_refuses_is_closed_all_the_same(server: FdServer) -> None:
    before = quiet(server)

    def take(batch: list[tuple[int, int]]) -> None:
        raise ProtocolError("not the pieces its region named")

    with pytest.raises(ProtocolError, match="not the pieces"):
        fetch_fds(server.source, 2, 150, take)
    assert quiet(server) == before


def test_nothing_stays_open_when_the_trainer_refuses(server: FdServer, files: Files) -> None:
    before = quiet(server)
    files.refuse = "the trainer's memory was remapped"
    with pytest.raises(AiosyncError, match="remapped"):
        collect(server.source, 1, 3)
    files.refuse = ""
    with pytest.raises(AiosyncError, match="no pieces"):
        collect(server.source, 7, 2)
    assert quiet(server) == before


def test_a_refusal_after_some_batches_closes_the_ones_received(
    server: FdServer, files: Files
) -> None:
    """Region 2 has 150 pieces; asking for 200 fails in the third batch of 64."""
    before = quiet(server)
    with pytest.raises(AiosyncError, match="no pieces 128"):
        collect(server.source, 2, 200)
    assert quiet(server) == before


def test_a_wrong_token_gets_nothing(server: FdServer) -> None:
    wrong = msgspec.structs.replace(server.source, token=b"x" * 32)
    with pytest.raises(AiosyncError, match="wrong token"):
        collect(wrong, 1, 3)


def test_an_engine_takes_descriptors_only_from_the_pid_its_hello_named(
    server: FdServer,
) -> None:
    before = quiet(server)
    other = msgspec.structs.replace(server.source, pid=server.source.pid + 1)
    with pytest.raises(AiosyncError, match="served by pid"):
        collect(other, 1, 3)
    elsewhere = msgspec.structs.replace(server.source, pid_namespace=1)
    with pytest.raises(AiosyncError, match="another PID namespace"):
        collect(elsewhere, 1, 3)
    assert quiet(server) == before


def test_a_trainer_that_cannot_be_reached_is_named() -> None:
    source = DescriptorSource("/nonexistent/regions.sock", os.getpid(), 0, b"t")
    with pytest.raises(AiosyncError, match=r"cannot reach .*runs on its host"):
        collect(source, 1, 1)


def test_region_sizes_are_bounded_before_anything_is_asked() -> None:
    source = DescriptorSource("/nonexistent/regions.sock", os.getpid(), 0, b"t")
    for count in (0, MAX_PIECES + 1):
        with pytest.raises(ProtocolError, match="pieces"):
            collect(source, 1, count)


class Hostile:
    """A trainer of the right pid that answers every request with ``extra`` descriptors
    more than asked for (or, with ``sizes``, the right number and too few sizes)."""

    def __init__(self, extra: int, *, sizes: bool = False) -> None:
        self.directory = make_private_dir()
        self.path = str(self.directory / "s.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.extra, self.sizes = extra, sizes
        self.null = os.open(os.devnull, os.O_RDONLY)  # what it sends, open throughout
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            request = msgspec.msgpack.decode(conn.recv(1 << 16))
            wanted = request["count"]
            sizes = [1] * (wanted - 1 if self.sizes else wanted)
            reply = msgspec.msgpack.encode(FdReply(sizes=sizes))
            socket.send_fds(conn, [reply], [self.null] * (wanted + self.extra))
            conn.recv(1)  # until the engine hangs up

    def close(self) -> None:
        self.thread.join(timeout=10)
        os.close(self.null)
        self.listener.close()
        os.unlink(self.path)
        self.directory.rmdir()


@pytest.mark.parametrize(("extra", "sizes"), [(5, False), (0, True)])
def test_answers_that_are_not_what_was_asked_are_refused_and_closed(
    extra: int, sizes: bool
) -> None:
    hostile = Hostile(extra, sizes=sizes)
    try:
        source = DescriptorSource(hostile.path, os.getpid(), _namespace(), b"t")
        before = open_files()
        with pytest.raises(ProtocolError, match=r"cut short|sizes"):
            collect(source, 1, 3)
        assert open_files() == before  # what came is closed (the hostile side holds none)
    finally:
        hostile.close()


def test_the_socket_is_the_trainer_s_in_a_directory_only_its_user_enters(
    server: FdServer,
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(server.source.path)
        pid, uid, _ = peer_credentials(sock)
    assert (pid, uid) == (os.getpid(), os.geteuid())
    assert oct(os.stat(os.path.dirname(server.source.path)).st_mode & 0o777) == "0o700"


def test_a_closed_server_removes_its_socket_and_serves_no_more(files: Files) -> None:
    serving = FdServer(files)
    path = serving.source.path
    serving.start()
    threads = threading.active_count()
    serving.close()
    serving.close()  # idempotent
    serving.start()  # not after close
    assert not os.path.exists(os.path.dirname(path))
    assert threading.active_count() == threads - 1
    with pytest.raises(AiosyncError, match="cannot reach"):
        collect(serving.source, 1, 3)


def test_a_malformed_request_is_answered_with_an_error(server: FdServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(server.source.path)
        sock.send(b"\x93not a request")
        reply = msgspec.msgpack.decode(sock.recv(1 << 16), type=FdReply)
    assert reply.error == "not a descriptor request"
    assert reply.sizes == []


def _namespace() -> int:
    from aiosync.private_dirs import pid_namespace

    return pid_namespace()


@pytest.mark.parametrize("hang_up", [False, True])
def test_a_trainer_that_goes_silent_or_hangs_up_is_an_aiosync_error(hang_up: bool) -> None:
    directory = make_private_dir()
    path = str(directory / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    accepted: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        if hang_up:
            conn.recv(1 << 16)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        source = DescriptorSource(path, os.getpid(), _namespace(), b"t")
        with pytest.raises(AiosyncError, match=r"timed out|closed its descriptor socket"):
            fetch_fds(source, 1, 3, lambda batch: None, timeout=0.3)
    finally:
        thread.join(timeout=10)
        for conn in accepted:
            conn.close()
        listener.close()
        os.unlink(path)
        directory.rmdir()
