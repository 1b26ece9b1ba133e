"""Data planes: shared-memory segments of both kinds, sealed memfds and /dev/shm files
(naming, attach checks, the sweep of dead creators' names), the shared-memory sender and
receiver planes, and the pipeline's independence of every plane and channel implementation.

Attacks on an engine's side of shared memory are in tests/api/test_shm_security.py.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aiosync.pipeline
import aiosync.planes.memfd as memfd
from aiosync.core.errors import AiosyncError
from aiosync.core.layout import (
    ALIGNMENT,
    TensorSpec,
    dtype_from_name,
    pack_bucket,
    plan_buckets,
    tensor_bytes,
)
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.planes import create_sender_plane, open_receiver_plane
from aiosync.planes.memfd import BACKEND_ENV, memfd_available
from aiosync.planes.shm import (
    Backend,
    ShmReceiverPlane,
    ShmSegment,
    ShmSenderPlane,
    open_segment,
)
from aiosync.planes.shm_files import SHM_DIR, sweep_stale_segments
from aiosync.private_dirs import pid_namespace
from aiosync.runtime import child_env
from tests.helpers.models import mixed_weights

CAPACITY = 64 * 1024


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


BACKENDS = ["memfd", "file"]


def reachable(handle: ShmHandle) -> bool:
    """Whether an engine can still open the segment (a file's name, a memfd's descriptor)."""
    try:
        fd, _ = open_segment(handle, max_size=handle.size)
    except AiosyncError:
        return False
    os.close(fd)
    return True


def held(token: str) -> int:
    """Mappings and descriptors of this process on the segment named with ``token``."""
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if token in line)
    described = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            described += token in os.readlink(f"/proc/self/fd/{fd}")
    return mapped + described


def token_of(name: str) -> str:
    return name.rsplit("-", 1)[1]


# --------------------------------------------------------------------------------------
# segments
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_round_trip_and_unlink_on_close(backend: Backend) -> None:
    segment = ShmSegment.create(4096, backend=backend)
    assert segment.backend == backend
    try:
        segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        other = ShmSegment.attach(segment.handle)
        assert other.backend == backend
        assert other.tensor[:4].tolist() == [1, 2, 3, 4]
        other.tensor[4] = 5  # shared both ways
        assert int(segment.tensor[4]) == 5
        other.close()
        assert reachable(segment.handle)  # only the creator unlinks
    finally:
        segment.close()
    assert not reachable(segment.handle)
    assert not (SHM_DIR / segment.name).exists()
    with pytest.raises(AiosyncError, match="closed"):
        _ = segment.tensor


def test_a_data_plane_makes_sealed_memfds_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert memfd_available()
    plane = ShmSenderPlane(1, CAPACITY)
    try:
        segment = plane._segments[0]
        assert segment.backend == "memfd"
        assert segment.name.startswith(f"aiosync-memfd-{pid_namespace()}-{os.getpid()}-")
        assert not (SHM_DIR / segment.name).exists()
        fd = int(segment.name.split("-")[4])
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:aiosync-")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & wanted == wanted
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # not even its creator can shrink it
    finally:
        plane.close()
    segment = ShmSegment.create(4096)  # a bare segment is still a /dev/shm file
    try:
        assert segment.backend == "file"
        assert (SHM_DIR / segment.name).is_file()
    finally:
        segment.close()


def test_the_environment_picks_the_planes_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "file")
    plane = ShmSenderPlane(1, CAPACITY)
    try:
        assert plane._segments[0].backend == "file"
        assert (SHM_DIR / plane.spec.buffers[0].name).is_file()
    finally:
        plane.close()
    monkeypatch.setenv(BACKEND_ENV, "memfd")
    plane = ShmSenderPlane(1, CAPACITY)
    try:
        assert plane._segments[0].backend == "memfd"
    finally:
        plane.close()
    monkeypatch.setenv(BACKEND_ENV, "tape")
    with pytest.raises(AiosyncError, match="AIOSYNC_SHM_BACKEND"):
        ShmSenderPlane(1, CAPACITY)


def test_without_memfds_a_plane_falls_back_to_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(memfd, "_memfd_device", lambda: None)
    plane = ShmSenderPlane(1, CAPACITY)
    try:
        assert plane._segments[0].backend == "file"
    finally:
        plane.close()
    with pytest.raises(AiosyncError, match="memfds cannot be made here"):
        ShmSegment.create(4096, backend="memfd")


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_is_private_to_this_user(backend: Backend) -> None:
    old = os.umask(0o277)  # a umask that would make a read-only file: the mode is set anyway
    try:
        segment = ShmSegment.create(4096, backend=backend)
    finally:
        os.umask(old)
    try:
        if backend == "file":
            info = (SHM_DIR / segment.name).lstat()
        else:
            info = os.stat(f"/proc/self/fd/{segment.name.split('-')[4]}")
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.geteuid()
        assert segment.handle == ShmHandle(segment.name, 4096)
    finally:
        segment.close()


@pytest.mark.parametrize("size", [0, -1])
def test_segment_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        ShmSegment.create(size)


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "aiosync-1-2-zz",
        "other-1-2-0123456789abcdef",
        "aiosync-1-abc",
        "aiosync-1-2-0123456789abcdef\n",  # a trailing newline: the whole name must match
        "aiosync-1-2-0123456789abcdef/x",
        "aiosync-memfd-1-2-0123456789abcdef",  # no descriptor number
        "aiosync-memfd-1-0-3-0123456789abcdef",  # pid 0
        "aiosync-memfd-1-2-03-0123456789abcdef",  # a leading zero
        f"aiosync-{'9' * 5000}-2-0123456789abcdef",  # a number int() would refuse
        "x" * 100_000,
    ],
)
def test_attach_refuses_names_that_are_not_ours(name: str) -> None:
    with pytest.raises(AiosyncError, match="refusing") as caught:
        ShmSegment.attach(ShmHandle(name=name, size=4096))
    assert len(str(caught.value)) < 200  # a peer's name is not repeated at length


@pytest.mark.parametrize("backend", BACKENDS)
def test_attach_checks_existence_and_size(backend: Backend) -> None:
    segment = ShmSegment.create(4096, backend=backend)
    try:
        with pytest.raises(AiosyncError, match="holds 4096 bytes, not 8192"):
            ShmSegment.attach(ShmHandle(name=segment.name, size=8192))
        with pytest.raises(AiosyncError, match="claims 4096 bytes, over the limit of 4095"):
            ShmSegment.attach(segment.handle, max_size=4095)
    finally:
        segment.close()
    with pytest.raises(AiosyncError, match="does not exist"):
        ShmSegment.attach(segment.handle)


def test_sweep_removes_names_of_dead_creators_in_this_namespace_only() -> None:
    namespace = os.stat("/proc/self/ns/pid").st_ino
    pid = dead_pid()
    ours_dead = SHM_DIR / f"aiosync-{namespace}-{pid}-0123456789abcdef"
    other_ns = SHM_DIR / f"aiosync-{namespace + 1}-{pid}-0123456789abcdef"
    alive = ShmSegment.create(4096, backend="file")
    try:
        ours_dead.write_bytes(b"x")
        other_ns.write_bytes(b"x")
        removed = sweep_stale_segments()
        assert ours_dead.name in removed
        assert not ours_dead.exists()
        assert other_ns.exists()  # a pid of another namespace proves nothing
        assert (SHM_DIR / alive.name).exists()  # its creator (us) is alive
    finally:
        alive.close()
        ours_dead.unlink(missing_ok=True)
        other_ns.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------
# shared-memory planes
# --------------------------------------------------------------------------------------


def unpack(views: list[tuple[torch.Tensor, list[TensorSpec]]]) -> dict[str, torch.Tensor]:
    """Rebuild whole tensors from bucket views and their specs (chunks put together)."""
    out: dict[str, torch.Tensor] = {}
    for view, specs in views:
        for spec in specs:
            whole = out.get(spec.name)
            if whole is None:
                whole = torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype))
                out[spec.name] = whole
            raw = view[spec.offset : spec.offset + spec.nbytes]
            tensor_bytes(whole)[spec.start : spec.start + spec.nbytes].copy_(raw)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_plane_spec_names_every_buffer(backend: Backend) -> None:
    plane = ShmSenderPlane(3, CAPACITY, backend=backend)
    try:
        spec = plane.spec
        assert isinstance(spec, ShmPlaneSpec)
        assert (plane.count, plane.capacity) == (3, CAPACITY)
        assert spec.sizes == [CAPACITY] * 3
        assert len({handle.name for handle in spec.buffers}) == 3
        assert all(reachable(handle) for handle in spec.buffers)
    finally:
        plane.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_then_view_through_another_plane_gives_the_same_bytes(backend: Backend) -> None:
    weights = mixed_weights()
    sender = ShmSenderPlane(2, CAPACITY, backend=backend)
    try:
        receiver = ShmReceiverPlane(sender.spec)  # as an engine opens it from the hello
        try:
            views = []
            for i, plan in enumerate(plan_buckets(weights.items(), CAPACITY)):
                index = i % sender.count
                sender.pack(index, plan)
                view = receiver.view(index, plan.used)
                assert view.dtype == torch.uint8
                assert view.shape == (plan.used,)
                expected = torch.zeros(plan.used, dtype=torch.uint8)
                pack_bucket(expected, plan)
                for spec in plan.specs:  # every tensor's bytes (padding is unspecified)
                    got = view[spec.offset : spec.offset + spec.nbytes]
                    assert torch.equal(got, expected[spec.offset : spec.offset + spec.nbytes])
                views.append((view.clone(), plan.specs))  # the buffer is reused next round
        finally:
            receiver.close()
    finally:
        sender.close()
    rebuilt = unpack(views)
    assert rebuilt.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(rebuilt[name], tensor), name
    assert len(views) > len(weights) // 2  # the big tensor went in several buckets


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_are_seen_by_an_open_view_without_reopening(backend: Backend) -> None:
    sender = ShmSenderPlane(1, CAPACITY, backend=backend)
    receiver = ShmReceiverPlane(sender.spec)
    try:
        for value in (1, 2):
            tensor = torch.full((8,), value, dtype=torch.int32)
            plan = next(plan_buckets([("x", tensor)], CAPACITY))
            sender.pack(0, plan)
            assert receiver.view(0, plan.used)[:32].view(torch.int32).eq(value).all()
    finally:
        receiver.close()
        sender.close()


def test_an_engine_maps_memfds_and_copies_files_out() -> None:
    """A sealed memfd is mapped (zero copies, a view sees later writes); a file, which
    could shrink, is only read (a view is a copy of the bytes when it was taken)."""
    for backend, mapped in (("memfd", True), ("file", False)):
        sender = ShmSenderPlane(1, CAPACITY, backend=backend)
        try:
            token = token_of(sender.spec.buffers[0].name)
            before = held(token)
            receiver = ShmReceiverPlane(sender.spec)
            try:
                sender._segments[0].tensor[:8] = 1
                view = receiver.view(0, 64)
                with open("/proc/self/maps") as maps:
                    maps_now = sum(1 for line in maps if token in line)
                assert maps_now == (2 if mapped else 1), backend  # the sender's own, and ours
                sender._segments[0].tensor[:8] = 2
                assert int(view[0]) == (2 if mapped else 1), backend
                assert int(receiver.view(0, 64)[0]) == 2
                del view
            finally:
                receiver.close()
            assert held(token) == before
        finally:
            sender.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_are_checked_against_the_plane(backend: Backend) -> None:
    sender = ShmSenderPlane(2, CAPACITY, backend=backend)
    receiver = ShmReceiverPlane(sender.spec)
    try:
        assert receiver.view(1, 0).numel() == 0
        assert receiver.view(1, CAPACITY).numel() == CAPACITY
        for index, used in ((2, 8), (-1, 8), (0, CAPACITY + 1), (0, -1)):
            with pytest.raises(AiosyncError, match="segment"):
                receiver.view(index, used)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_unlinks_the_names_and_the_receiver_does_not(backend: Backend) -> None:
    sender = ShmSenderPlane(2, CAPACITY, backend=backend)
    handles = sender.spec.buffers
    receiver = ShmReceiverPlane(sender.spec)
    plan = next(plan_buckets([("x", torch.arange(16, dtype=torch.int64))], CAPACITY))
    sender.pack(1, plan)
    view = receiver.view(1, plan.used)
    receiver.close()
    assert all(reachable(handle) for handle in handles)  # the sender owns the segments
    receiver.close()  # idempotent
    sender.close()
    assert not any(reachable(handle) for handle in handles)
    assert not any((SHM_DIR / handle.name).exists() for handle in handles)
    sender.close()  # idempotent
    # a view taken before close still reads the bytes (a mapping outlives the name)
    assert torch.equal(view[:128].view(torch.int64), torch.arange(16, dtype=torch.int64))
    # but nobody can open the plane any more
    with pytest.raises(AiosyncError, match="does not exist"):
        ShmReceiverPlane(ShmPlaneSpec([handles[0]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_plane_refuses_a_bad_buffer_and_keeps_nothing_open(backend: Backend) -> None:
    sender = ShmSenderPlane(1, CAPACITY, backend=backend)
    try:
        good = sender.spec.buffers[0]
        before = held(token_of(good.name))  # the sender's own
        for bad in (ShmHandle("../etc/passwd", CAPACITY), ShmHandle(good.name, 2 * CAPACITY)):
            with pytest.raises(AiosyncError):
                ShmReceiverPlane(ShmPlaneSpec([good, bad]))
            assert held(token_of(good.name)) == before  # the good buffer opened first was let go
    finally:
        sender.close()


def test_receiver_plane_limits_buffers_and_bytes() -> None:
    sender = ShmSenderPlane(3, CAPACITY)
    try:
        token = token_of(sender.spec.buffers[0].name)
        before = held(token)
        with pytest.raises(AiosyncError, match="3 segments is over the limit of 2"):
            ShmReceiverPlane(sender.spec, max_buffers=2)
        with pytest.raises(AiosyncError, match=f"{3 * CAPACITY} bytes is over the limit"):
            ShmReceiverPlane(sender.spec, max_bytes=3 * CAPACITY - 1)
        with pytest.raises(AiosyncError, match="over the limit"):
            ShmReceiverPlane(sender.spec, max_bytes=CAPACITY - 1)
        assert held(token) == before  # refused before anything was opened
        ShmReceiverPlane(sender.spec, max_buffers=3, max_bytes=3 * CAPACITY).close()
    finally:
        sender.close()


def test_sender_plane_that_fails_to_build_leaves_no_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[ShmSegment] = []
    create = ShmSegment.create

    def third_fails(
        size: int, *, backend: Backend = "file", seal_writes: bool = False
    ) -> ShmSegment:
        if len(made) == 2:
            raise OSError(28, "No space left on device")
        made.append(create(size, backend=backend, seal_writes=seal_writes))
        return made[-1]

    monkeypatch.setattr(ShmSegment, "create", third_fails)
    with pytest.raises(OSError, match="No space left"):
        ShmSenderPlane(3, CAPACITY)
    assert len(made) == 2
    assert not any(reachable(segment.handle) for segment in made)


def test_plane_factories_pick_shared_memory_on_the_cpu() -> None:
    plane = create_sender_plane(torch.device("cpu"), 2, CAPACITY)
    try:
        assert isinstance(plane, ShmSenderPlane)
        opened = open_receiver_plane(plane.spec, torch.device("cpu"))
        try:
            assert isinstance(opened, ShmReceiverPlane)
        finally:
            opened.close()
    finally:
        plane.close()
    with pytest.raises(ValueError, match="no data plane"):
        create_sender_plane(torch.device("meta"), 2, CAPACITY)
    assert CAPACITY % ALIGNMENT == 0


# --------------------------------------------------------------------------------------
# the pipeline knows only the interfaces
# --------------------------------------------------------------------------------------

IMPLEMENTATIONS = (
    "zmq",
    "aiosync.planes.shm",
    "aiosync.planes.shm_files",
    "aiosync.planes.memfd",
    "aiosync.planes.cuda",
    "aiosync.planes.cuda_handles",
    "aiosync.channels.zmq",
    "aiosync.channels.zmq_common",
    "aiosync.channels.zmq_listener",
)


def test_importing_the_pipeline_loads_no_channel_or_plane_implementation() -> None:
    code = (
        "import json, sys\n"
        "import aiosync.pipeline.stream, aiosync.pipeline.links, aiosync.pipeline.fanout\n"
        "import aiosync.pipeline.ledger, aiosync.pipeline.report\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = set(json.loads(out.stdout))
    assert "aiosync.pipeline.stream" in loaded  # the probe did import the pipeline
    found = {m for m in loaded for bad in IMPLEMENTATIONS if m == bad or m.startswith(bad + ".")}
    assert not found, f"the pipeline pulled in {sorted(found)}"


def test_pipeline_source_names_no_channel_or_plane_implementation() -> None:
    """Also imports inside functions, which the import probe above cannot see."""
    package = Path(aiosync.pipeline.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                bad = [b for b in IMPLEMENTATIONS if name == b or name.startswith(b + ".")]
                assert not bad, f"{path.name} imports {name}"
