"""Attacks on an engine's side of shared memory (issue 8, items 1, 2, 3 and 7).

The attacker is a peer that sends the engine a ``ShmHandle`` (a name and a size) of its
choosing and can do anything to files this user may touch. The engine opens handles with
:class:`ShmReceiverPlane` (what a session does with a hello) or :meth:`ShmSegment.attach`.
Every attack must end in an :class:`AiosyncError` naming the segment and what is wrong, a
file it never created left untouched, and a live engine: readers that could crash run in a
subprocess, which must exit normally.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosync.planes.memfd as memfd
import aiosync.planes.shm as shm
from aiosync.core.errors import AiosyncError
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.planes.memfd import memory_free
from aiosync.planes.shm import ShmReceiverPlane, ShmSegment, ShmSenderPlane
from aiosync.planes.shm_files import SHM_DIR, sweep_stale_segments
from aiosync.private_dirs import pid_namespace
from aiosync.runtime import child_env

SIZE = 64 * 1024
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; not exported by Python 3.11's fcntl
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's file")


def attach(handle: ShmHandle) -> None:
    ShmSegment.attach(handle).close()


def receive(handle: ShmHandle) -> None:
    ShmReceiverPlane(ShmPlaneSpec([handle])).close()


OPENERS = [pytest.param(attach, id="attach"), pytest.param(receive, id="plane")]
Opener = Callable[[ShmHandle], None]


def segment_name(pid: int | None = None) -> str:
    """A fresh name of the /dev/shm form (of this live process unless ``pid`` is given)."""
    return f"aiosync-{pid_namespace()}-{pid or os.getpid()}-{secrets.token_hex(8)}"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def aiosync_descriptors() -> set[str]:
    """This process's descriptors on aiosync segments (memfds and /dev/shm files)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "aiosync-" in target:
                found.add(f"{fd} -> {target}")
    return found


@pytest.fixture(autouse=True)
def nothing_left_open() -> Iterator[None]:
    """A refused segment leaves no descriptor behind (the mappings' are checked per test)."""
    before = aiosync_descriptors()
    yield
    assert aiosync_descriptors() <= before


@pytest.fixture
def planted() -> Iterator[Callable[[str], Path]]:
    """Paths in /dev/shm that the test plants; all removed afterwards, whatever they are."""
    paths: list[Path] = []

    def plant(name: str) -> Path:
        paths.append(SHM_DIR / name)
        return paths[-1]

    yield plant
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of this user's that no segment should ever touch."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious" * (SIZE // 8))
    path.chmod(0o600)
    return path


def untouched(path: Path, content: bytes, info: os.stat_result) -> bool:
    now = path.stat()
    return path.read_bytes() == content and (now.st_size, now.st_mtime_ns) == (
        info.st_size,
        info.st_mtime_ns,
    )


def write_file(path: Path, size: int = SIZE, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


@contextlib.contextmanager
def hostile_memfd(
    size: int = SIZE, *, seals: int = SEALS, mode: int = 0o600, uid: int | None = None
) -> Iterator[ShmHandle]:
    """A memfd made by hand as a peer might, and a handle naming it."""
    token = secrets.token_hex(8)
    ns, pid = pid_namespace(), os.getpid()
    fd = os.memfd_create(f"aiosync-{ns}-{pid}-{token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        if size > 0:  # reserved, as a trainer's is: a sparse segment is refused
            os.posix_fallocate(fd, 0, size)
        if uid is not None:
            os.fchown(fd, uid, uid)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        yield ShmHandle(f"aiosync-memfd-{ns}-{pid}-{fd}-{token}", size)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------
# files in /dev/shm: what an engine opens by name
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("opener", OPENERS)
def test_a_symlink_named_like_a_segment_is_refused_and_its_target_untouched(
    opener: Opener, planted: Callable[[str], Path], victim: Path
) -> None:
    content, info = victim.read_bytes(), victim.stat()
    link = planted(segment_name())
    link.symlink_to(victim)
    for size in (SIZE, 2 * SIZE):  # the right size, and one that would have grown it
        with pytest.raises(AiosyncError, match=f"{link.name}' is a symbolic link"):
            opener(ShmHandle(link.name, size))
    assert untouched(victim, content, info)


def test_a_symlink_to_a_real_segment_is_refused_too(planted: Callable[[str], Path]) -> None:
    """Not only foreign targets: a segment is reached by its own name or not at all."""
    segment = ShmSegment.create(SIZE, backend="file")
    try:
        link = planted(segment_name())
        link.symlink_to(SHM_DIR / segment.name)
        with pytest.raises(AiosyncError, match="symbolic link"):
            receive(ShmHandle(link.name, SIZE))
    finally:
        segment.close()


def test_a_swap_to_a_symlink_after_the_check_cannot_redirect_the_engine(
    monkeypatch: pytest.MonkeyPatch, victim: Path
) -> None:
    """Impossible by construction: the engine opens the name exactly once, with
    ``O_NOFOLLOW`` (and without ``O_CREAT``) relative to a descriptor of /dev/shm, and
    from then on uses only that descriptor: every check is an ``fstat`` of it and every
    bucket is read from it. There is no second lookup of the name for a swap to win
    against. A symlink in place before the open is refused by ``O_NOFOLLOW``; one swapped
    in during the checks leaves the opened file without a name (refused: it was removed);
    one swapped in later is never looked at. Both late swaps are tried here, at the worst
    moments, and the victim is never read nor written."""
    content, info = victim.read_bytes(), victim.stat()
    real_open = os.open

    def swap_in_symlink(name: str) -> None:
        swap = SHM_DIR / f"{name}.swap"
        swap.symlink_to(victim)
        swap.rename(SHM_DIR / name)  # atomically: the name is now a symlink to the victim

    # 1. right after the one open, before the checks on the descriptor
    sender = ShmSenderPlane(1, SIZE, backend="file")
    name = sender.spec.buffers[0].name
    opens: list[int] = []

    def open_then_swap(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if path == name:
            opens.append(flags)
            swap_in_symlink(name)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    try:
        with pytest.raises(AiosyncError, match="was removed as it was opened"):
            ShmReceiverPlane(sender.spec)
    finally:
        monkeypatch.undo()
        sender.close()  # unlinks the name: the symlink, not its target
    assert len(opens) == 1
    assert opens[0] & os.O_NOFOLLOW
    assert not opens[0] & os.O_CREAT

    # 2. after the plane is open: the engine keeps reading the segment it checked
    sender = ShmSenderPlane(1, SIZE, backend="file")
    name = sender.spec.buffers[0].name
    sender._segments[0].tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    try:
        receiver = ShmReceiverPlane(sender.spec)
        try:
            swap_in_symlink(name)
            assert receiver.view(0, 4).tolist() == [1, 2, 3, 4]  # the segment's bytes
        finally:
            receiver.close()
    finally:
        sender.close()
    assert untouched(victim, content, info)


def test_a_memfd_descriptor_reused_after_the_check_cannot_redirect_the_engine(
    victim: Path,
) -> None:
    """The memfd form resolves ``/proc/<pid>/fd/<n>`` once, checks what it reached and
    keeps that: closing the descriptor afterwards and opening the victim at the same
    number changes nothing for an engine that already holds the segment."""
    content, info = victim.read_bytes(), victim.stat()
    segment = ShmSegment.create(SIZE, backend="memfd")
    segment.tensor[:4] = 7
    receiver = ShmReceiverPlane(ShmPlaneSpec([segment.handle]))
    try:
        number = int(segment.name.split("-")[4])
        segment.unlink()  # closes descriptor <number>
        fd = os.open(victim, os.O_RDWR)
        try:
            if fd == number:  # the number now names the victim: a new open is refused
                with pytest.raises(AiosyncError, match="is another file"):
                    receive(segment.handle)
            assert receiver.view(0, 4).tolist() == [7, 7, 7, 7]
        finally:
            os.close(fd)
    finally:
        receiver.close()
        segment.close()
    assert untouched(victim, content, info)


@pytest.mark.parametrize("opener", OPENERS)
def test_wrong_sizes_are_refused(opener: Opener, planted: Callable[[str], Path]) -> None:
    path = planted(segment_name())
    write_file(path)
    for claimed in (SIZE + 1, SIZE - 1, 2 * SIZE):
        with pytest.raises(AiosyncError, match=f"{path.name}' holds {SIZE} bytes, not {claimed}"):
            opener(ShmHandle(path.name, claimed))
    for claimed in (0, -1):
        with pytest.raises(AiosyncError, match=f"claims {claimed} bytes"):
            opener(ShmHandle(path.name, claimed))
    assert path.stat().st_size == SIZE  # never grown, never shrunk


def test_a_size_over_the_callers_limit_is_refused_before_opening(
    planted: Callable[[str], Path],
) -> None:
    path = planted(segment_name())
    write_file(path)
    with pytest.raises(AiosyncError, match=f"claims {SIZE} bytes, over the limit of 4096"):
        ShmSegment.attach(ShmHandle(path.name, SIZE), max_size=4096)
    with pytest.raises(AiosyncError, match="over the limit of 4096"):
        ShmReceiverPlane(ShmPlaneSpec([ShmHandle(path.name, SIZE)]), max_bytes=4096)


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o400, 0o700, 0o4600])
def test_a_wrong_mode_is_refused(opener: Opener, mode: int, planted: Callable[[str], Path]) -> None:
    path = planted(segment_name())
    write_file(path, mode=mode)
    with pytest.raises(AiosyncError, match=f"has mode {mode:o}, not 600"):
        opener(ShmHandle(path.name, SIZE))


@as_root
@pytest.mark.parametrize("opener", OPENERS)
def test_another_users_file_is_refused(opener: Opener, planted: Callable[[str], Path]) -> None:
    path = planted(segment_name())
    write_file(path)
    os.chown(path, 65534, 65534)
    with pytest.raises(AiosyncError, match="is owned by uid 65534, not this user"):
        opener(ShmHandle(path.name, SIZE))


@pytest.mark.parametrize("opener", OPENERS)
def test_a_directory_or_fifo_named_like_a_segment_is_refused(
    opener: Opener, planted: Callable[[str], Path]
) -> None:
    directory = planted(segment_name())
    directory.mkdir(mode=0o700)
    with pytest.raises(AiosyncError, match=f"{directory.name}' is a directory"):
        opener(ShmHandle(directory.name, SIZE))
    fifo = planted(segment_name())
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    with pytest.raises(AiosyncError, match=f"{fifo.name}' is a FIFO"):
        opener(ShmHandle(fifo.name, SIZE))
    assert time.monotonic() - started < 5  # opening it did not wait for a writer


def test_a_second_name_for_a_file_is_refused(planted: Callable[[str], Path]) -> None:
    path = planted(segment_name())
    write_file(path)
    alias = planted(segment_name())
    os.link(path, alias)
    with pytest.raises(AiosyncError, match="has 2 names, not 1"):
        receive(ShmHandle(alias.name, SIZE))


# --------------------------------------------------------------------------------------
# memfds: what an engine opens through /proc/<pid>/fd/<n>
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("opener", OPENERS)
def test_an_unsealed_memfd_is_refused(opener: Opener) -> None:
    for seals in (0, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL, fcntl.F_SEAL_SHRINK):
        with (
            hostile_memfd(seals=seals) as handle,
            pytest.raises(AiosyncError, match="not sealed against shrinking and growing"),
        ):
            opener(handle)


@pytest.mark.parametrize("seal", [fcntl.F_SEAL_WRITE, F_SEAL_FUTURE_WRITE])
def test_a_memfd_sealed_against_writes_is_read_but_never_attached_writable(seal: int) -> None:
    """Engines map read-only, so a write seal is no obstacle; a writable attach is refused."""
    probe = os.memfd_create("aiosync-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(probe, fcntl.F_ADD_SEALS, seal)
    except OSError:
        pytest.skip("this kernel has no such seal (F_SEAL_FUTURE_WRITE needs Linux 5.1)")
    finally:
        os.close(probe)
    with hostile_memfd(seals=SEALS | seal) as handle:
        receive(handle)
        ShmSegment.attach(handle, writable=False).close()
        with pytest.raises(AiosyncError, match="sealed against writing"):
            ShmSegment.attach(handle)


def test_a_memfd_of_the_wrong_mode_size_or_owner_is_refused() -> None:
    with hostile_memfd(mode=0o644) as handle, pytest.raises(AiosyncError, match="mode 644"):
        receive(handle)
    with hostile_memfd() as handle, pytest.raises(AiosyncError, match="not 131072"):
        receive(ShmHandle(handle.name, 2 * SIZE))
    if os.geteuid() == 0:
        with hostile_memfd(uid=65534) as handle, pytest.raises(AiosyncError, match="uid 65534"):
            receive(handle)


def test_a_memfd_on_another_filesystem_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """hugetlbfs memfds can be sealed too, but a hole punched in one faults (SIGBUS) when
    huge pages run out; an engine maps only memfds of the filesystem its own are on."""
    with hostile_memfd() as handle:
        receive(handle)  # as made, it passes
        real = memfd._memfd_device()
        assert real is not None
        monkeypatch.setattr(memfd, "_memfd_device", lambda: real + 1)
        with pytest.raises(AiosyncError, match="not an ordinary memfd"):
            receive(handle)


@pytest.mark.parametrize("opener", OPENERS)
def test_a_handle_naming_a_descriptor_that_is_not_a_segment_is_refused(
    opener: Opener, victim: Path
) -> None:
    """O_PATH reaches whatever the descriptor is without opening it; nothing is done to it."""
    content, info = victim.read_bytes(), victim.stat()
    ns, pid, token = pid_namespace(), os.getpid(), secrets.token_hex(8)
    read_end, write_end = os.pipe()
    file_fd = os.open(victim, os.O_RDONLY)
    try:
        cases = {read_end: "is a FIFO", file_fd: "is another file", 0: "does not exist"}
        for number, wanted in cases.items():
            with pytest.raises(AiosyncError, match=wanted):
                opener(ShmHandle(f"aiosync-memfd-{ns}-{pid}-{number}-{token}", SIZE))
        with pytest.raises(AiosyncError, match="has no descriptor 999999"):
            opener(ShmHandle(f"aiosync-memfd-{ns}-{pid}-999999-{token}", SIZE))
    finally:
        os.close(file_fd)
        os.close(read_end)
        os.close(write_end)
    assert untouched(victim, content, info)


def test_a_memfd_of_a_dead_process_or_another_namespace_is_refused() -> None:
    ns, token = pid_namespace(), secrets.token_hex(8)
    with pytest.raises(AiosyncError, match=r"does not exist \(its creator, pid \d+, is gone\)"):
        receive(ShmHandle(f"aiosync-memfd-{ns}-{dead_pid()}-3-{token}", SIZE))
    with pytest.raises(AiosyncError, match="another PID namespace"):
        receive(ShmHandle(f"aiosync-memfd-{ns + 1}-{os.getpid()}-3-{token}", SIZE))


# --------------------------------------------------------------------------------------
# a segment shrunk under an engine: it must survive
# --------------------------------------------------------------------------------------

READER = """
import json, sys
from aiosync.core.errors import AiosyncError
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.planes.shm import ShmReceiverPlane, ShmSegment

args = json.loads(sys.argv[1])
handle = ShmHandle(args["name"], args["size"])
if args["how"] == "map":  # what engines did before: map the file by its name
    tensor = ShmSegment.attach(handle).tensor
    read = lambda: int(tensor[: args["used"]].sum())
else:
    plane = ShmReceiverPlane(ShmPlaneSpec([handle]))
    read = lambda: int(plane.view(0, args["used"]).sum())
print("ready", flush=True)
sys.stdin.readline()
ok = errors = 0
last = ""
for _ in range(args["reads"]):
    try:
        total = read()
        ok += 1
    except AiosyncError as exc:
        errors += 1
        last = str(exc)
print(json.dumps({"ok": ok, "errors": errors, "last": last}), flush=True)
"""


def run_reader(
    handle: ShmHandle, how: str, attack: Callable[[], None], reads: int = 1
) -> subprocess.CompletedProcess[str]:
    """A reader of ``handle`` in a child; ``attack`` runs once it holds the segment."""
    args = {"name": handle.name, "size": handle.size, "used": handle.size, "reads": reads}
    args["how"] = how
    child = subprocess.Popen(
        [sys.executable, "-c", READER, json.dumps(args)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr
        attack()
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_the_attack_is_real_a_mapped_file_shrunk_kills_its_reader() -> None:
    """The control: a reader that maps a file (as engines did) dies by SIGBUS."""
    segment = ShmSegment.create(SIZE, backend="file")
    try:
        done = run_reader(segment.handle, "map", lambda: os.truncate(SHM_DIR / segment.name, 0))
    finally:
        segment.close()
    assert done.returncode == -signal.SIGBUS


def test_a_file_shrunk_under_an_engine_is_an_error_not_a_crash() -> None:
    segment = ShmSegment.create(SIZE, backend="file")
    try:
        done = run_reader(
            segment.handle, "plane", lambda: os.truncate(SHM_DIR / segment.name, 0), reads=3
        )
    finally:
        segment.close()
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["errors"] == 3
    assert f"{segment.name}' now holds 0 bytes, not {SIZE}" in result["last"]


def test_a_file_resized_over_and_over_while_an_engine_reads_never_crashes_it() -> None:
    """The size checked before each read can change during it: a short read is an
    error too, and the reader never maps the file, so no moment is a SIGBUS."""
    segment = ShmSegment.create(SIZE, backend="file")
    stop = threading.Event()

    def flip() -> None:
        path = SHM_DIR / segment.name
        while not stop.is_set():
            os.truncate(path, 0)
            os.truncate(path, SIZE)

    flipper = threading.Thread(target=flip)
    try:
        done = run_reader(segment.handle, "plane", flipper.start, reads=2000)
    finally:
        stop.set()
        if flipper.is_alive():
            flipper.join()
        segment.close()
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["ok"] + result["errors"] == 2000
    if result["errors"]:
        assert "segment" in result["last"]


def test_a_sealed_memfd_cannot_be_shrunk_under_an_engine() -> None:
    segment = ShmSegment.create(SIZE, backend="memfd")
    segment.tensor.fill_(1)
    number = int(segment.name.split("-")[4])
    refused: list[int] = []

    def shrink() -> None:
        for target in (number, os.open(f"/proc/self/fd/{number}", os.O_RDWR)):
            try:
                os.ftruncate(target, 0)
            except OSError as exc:
                refused.append(exc.errno or 0)
            if target != number:
                os.close(target)

    try:
        done = run_reader(segment.handle, "plane", shrink, reads=3)
    finally:
        segment.close()
    assert refused == [errno.EPERM, errno.EPERM]  # the creator itself cannot shrink it
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"ok": 3, "errors": 0, "last": ""}


# --------------------------------------------------------------------------------------
# creation: the memory is there before anything is made
# --------------------------------------------------------------------------------------


def shm_names() -> set[str]:
    return {path.name for path in SHM_DIR.glob(f"aiosync-*-{os.getpid()}-*")}


def test_asking_for_more_than_dev_shm_has_free_fails_before_making_anything() -> None:
    vfs = os.statvfs(SHM_DIR)
    size = vfs.f_bavail * vfs.f_frsize + (1 << 30)
    before = shm_names()
    with pytest.raises(AiosyncError) as caught:
        ShmSegment.create(size, backend="file")
    message = str(caught.value)
    assert f"cannot reserve {size} bytes of shared memory: /dev/shm has " in message
    assert "bytes free" in message
    assert shm_names() == before


def test_asking_for_more_memory_than_is_free_fails_before_making_a_memfd() -> None:
    free = memory_free()
    assert free is not None
    size = free + (1 << 30)
    before = aiosync_descriptors()
    with pytest.raises(AiosyncError, match=f"cannot reserve {size} bytes of shared memory: "):
        ShmSegment.create(size, backend="memfd")
    assert aiosync_descriptors() == before


@pytest.mark.parametrize("backend", ["memfd", "file"])
def test_a_failed_reservation_is_an_error_and_leaves_nothing(
    backend: shm.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free space can go between the check and the reservation: still an error."""

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = shm_names()
    with pytest.raises(AiosyncError, match=r"cannot reserve 65536 bytes .*No space left"):
        ShmSenderPlane(2, SIZE, backend=backend)
    assert shm_names() == before


# --------------------------------------------------------------------------------------
# the stale-segment sweep: best effort, never raises
# --------------------------------------------------------------------------------------


def test_planted_names_are_never_swept_and_never_stop_a_sender(
    planted: Callable[[str], Path], victim: Path
) -> None:
    content, info = victim.read_bytes(), victim.stat()
    pid = dead_pid()
    directory = planted(segment_name(pid))
    directory.mkdir()
    (planted(segment_name(pid))).symlink_to(victim)
    planted(segment_name(pid)).symlink_to(SHM_DIR / "nowhere")
    os.mkfifo(planted(segment_name(pid)))
    write_file(planted(segment_name()))  # a live creator's (ours)
    write_file(planted(segment_name(pid) + "\n"))  # not the whole name
    write_file(planted(f"aiosync-{pid_namespace()}-{'9' * 200}-{secrets.token_hex(8)}"))
    theirs = planted(segment_name(pid))
    write_file(theirs)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    names = {path.name for path in SHM_DIR.iterdir()}
    # (other test runs on this machine may leave dead pids' files, which are fair game)
    assert not set(sweep_stale_segments()) & names
    assert sweep_stale_segments(SHM_DIR / "missing") == []
    for backend in ("memfd", "file"):
        ShmSenderPlane(2, SIZE, backend=backend).close()  # each made segment sweeps first
    assert names <= {path.name for path in SHM_DIR.iterdir()}
    assert untouched(victim, content, info)


def test_a_dead_creators_own_file_is_still_swept(planted: Callable[[str], Path]) -> None:
    stale = planted(segment_name(dead_pid()))
    write_file(stale)
    assert stale.name in sweep_stale_segments()
    assert not stale.exists()
