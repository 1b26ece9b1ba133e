"""Data planes: shared-memory segments (naming, attach checks, the sweep of dead creators'
names), the shared-memory sender and receiver planes, and the pipeline's independence of
every plane and channel implementation.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aiosync.pipeline
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
from aiosync.planes.shm import (
    SHM_DIR,
    ShmReceiverPlane,
    ShmSegment,
    ShmSenderPlane,
    sweep_stale_segments,
)
from aiosync.runtime import child_env
from tests.models import mixed_weights

CAPACITY = 64 * 1024


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --------------------------------------------------------------------------------------
# segments
# --------------------------------------------------------------------------------------


def test_segment_round_trip_and_unlink_on_close() -> None:
    segment = ShmSegment.create(4096)
    try:
        segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        other = ShmSegment.attach(segment.handle)
        assert other.tensor[:4].tolist() == [1, 2, 3, 4]
        other.close()
        assert (SHM_DIR / segment.name).exists()  # only the creator unlinks
    finally:
        segment.close()
    assert not (SHM_DIR / segment.name).exists()
    with pytest.raises(AiosyncError, match="closed"):
        _ = segment.tensor


def test_segment_is_private_to_this_user() -> None:
    segment = ShmSegment.create(4096)
    try:
        assert (SHM_DIR / segment.name).stat().st_mode & 0o777 == 0o600
        assert segment.handle == ShmHandle(segment.name, 4096)
    finally:
        segment.close()


@pytest.mark.parametrize("size", [0, -1])
def test_segment_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        ShmSegment.create(size)


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "aiosync-1-2-zz", "other-1-2-0123456789abcdef", "aiosync-1-abc"]
)
def test_attach_refuses_names_that_are_not_ours(name: str) -> None:
    with pytest.raises(AiosyncError, match="refusing"):
        ShmSegment.attach(ShmHandle(name=name, size=4096))


def test_attach_checks_existence_and_size() -> None:
    segment = ShmSegment.create(4096)
    try:
        with pytest.raises(AiosyncError, match="holds 4096 bytes, not 8192"):
            ShmSegment.attach(ShmHandle(name=segment.name, size=8192))
    finally:
        segment.close()
    with pytest.raises(AiosyncError, match="does not exist"):
        ShmSegment.attach(segment.handle)


def test_sweep_removes_names_of_dead_creators_in_this_namespace_only() -> None:
    namespace = os.stat("/proc/self/ns/pid").st_ino
    pid = dead_pid()
    ours_dead = SHM_DIR / f"aiosync-{namespace}-{pid}-0123456789abcdef"
    other_ns = SHM_DIR / f"aiosync-{namespace + 1}-{pid}-0123456789abcdef"
    alive = ShmSegment.create(4096)
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


def test_sender_plane_spec_names_every_buffer() -> None:
    plane = ShmSenderPlane(3, CAPACITY)
    try:
        spec = plane.spec
        assert isinstance(spec, ShmPlaneSpec)
        assert (plane.count, plane.capacity) == (3, CAPACITY)
        assert spec.sizes == [CAPACITY] * 3
        assert len({handle.name for handle in spec.buffers}) == 3
        assert all((SHM_DIR / handle.name).exists() for handle in spec.buffers)
    finally:
        plane.close()


def test_pack_then_view_through_another_plane_gives_the_same_bytes() -> None:
    weights = mixed_weights()
    sender = ShmSenderPlane(2, CAPACITY)
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


def test_writes_are_seen_by_an_open_view_without_reopening() -> None:
    sender = ShmSenderPlane(1, CAPACITY)
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


def test_close_unlinks_the_names_and_the_receiver_does_not() -> None:
    sender = ShmSenderPlane(2, CAPACITY)
    names = [handle.name for handle in sender.spec.buffers]
    receiver = ShmReceiverPlane(sender.spec)
    plan = next(plan_buckets([("x", torch.arange(16, dtype=torch.int64))], CAPACITY))
    sender.pack(1, plan)
    view = receiver.view(1, plan.used)
    receiver.close()
    assert all((SHM_DIR / name).exists() for name in names)  # the sender owns the names
    receiver.close()  # idempotent
    sender.close()
    assert not any((SHM_DIR / name).exists() for name in names)
    sender.close()  # idempotent
    # a mapping outlives the name: a view taken before close still reads the bytes
    assert torch.equal(view[:128].view(torch.int64), torch.arange(16, dtype=torch.int64))
    # but nobody can open the plane any more
    with pytest.raises(AiosyncError, match="does not exist"):
        ShmReceiverPlane(ShmPlaneSpec([ShmHandle(names[0], CAPACITY)]))


def mappings(name: str) -> int:
    """How many times this process maps shared-memory segment ``name``."""
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if name in line)


def test_receiver_plane_refuses_a_bad_buffer_and_keeps_nothing_open() -> None:
    sender = ShmSenderPlane(1, CAPACITY)
    try:
        good = sender.spec.buffers[0]
        assert mappings(good.name) == 1  # the sender's own
        for bad in (ShmHandle("../etc/passwd", CAPACITY), ShmHandle(good.name, 2 * CAPACITY)):
            with pytest.raises(AiosyncError):
                ShmReceiverPlane(ShmPlaneSpec([good, bad]))
            assert mappings(good.name) == 1  # the good buffer mapped first was let go
    finally:
        sender.close()


def test_sender_plane_that_fails_to_build_leaves_no_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[ShmSegment] = []
    create = ShmSegment.create

    def third_fails(size: int) -> ShmSegment:
        if len(made) == 2:
            raise OSError(28, "No space left on device")
        made.append(create(size))
        return made[-1]

    monkeypatch.setattr(ShmSegment, "create", third_fails)
    with pytest.raises(OSError, match="No space left"):
        ShmSenderPlane(3, CAPACITY)
    assert len(made) == 2
    assert not any((SHM_DIR / segment.name).exists() for segment in made)


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

IMPLEMENTATIONS = ("zmq", "aiosync.planes.shm", "aiosync.planes.cuda_ipc", "aiosync.channels.zmq")


def test_importing_the_pipeline_loads_no_channel_or_plane_implementation() -> None:
    code = (
        "import json, sys\n"
        "import aiosync.pipeline.stream, aiosync.pipeline.links\n"
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
