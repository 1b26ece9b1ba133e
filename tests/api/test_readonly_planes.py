"""An engine never gets write access to a trainer's (or the server's) shared memory.

A memfd plane is mapped ``PROT_READ`` from a read-only descriptor: the mapping in
``/proc/self/maps`` is ``r--s``, and a write through an engine's view kills only the engine
(SIGSEGV) and leaves the trainer's bytes as they were. The ``/dev/shm`` fallback is opened
read-only and never mapped: the engine reads into its own buffer. Segments a trainer's plane
or the weight server makes are also sealed against writes through anything but their
creator's own view (``F_SEAL_FUTURE_WRITE``), which the creator keeps writing through.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator

import anyio
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.core.errors import AiosyncError
from aiosync.core.layout import TensorSpec
from aiosync.core.wire import ShmPlaneSpec
from aiosync.planes.memfd import memfd_available
from aiosync.planes.shm import ShmReceiverPlane, ShmSegment, ShmSenderPlane
from aiosync.server import ServerConfig, Subscriber, WeightServer

SIZE = 64 * 1024
WAIT = 30.0
needs_memfd = pytest.mark.skipif(not memfd_available(), reason="no sealed memfds here")


def mapping_of(address: int) -> tuple[str, str]:
    """The permissions and path of this process's mapping that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def descriptor_flags(name: str) -> dict[str, int]:
    """The open flags of each of this process's descriptors on the file called ``name``."""
    flags = {}
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if name in os.readlink(f"/proc/self/fd/{n}"):
                with open(f"/proc/self/fdinfo/{n}") as info:
                    flags[n] = int(info.read().split("flags:")[1].split()[0], 8)
    return flags


def future_write_sealable() -> bool:
    probe = os.memfd_create("aiosync-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        import fcntl

        fcntl.fcntl(probe, fcntl.F_ADD_SEALS, 0x0010)  # F_SEAL_FUTURE_WRITE
    except OSError:
        return False
    finally:
        os.close(probe)
    return True


@pytest.fixture
def segment(request: pytest.FixtureRequest) -> Iterator[ShmSegment]:
    """A trainer-side segment (as a sender plane makes it) holding 0, 1, 2, ... 255, 0, ..."""
    made = ShmSegment.create(SIZE, backend=request.param, seal_writes=True)
    try:
        made.tensor.copy_(torch.arange(SIZE, dtype=torch.int64).remainder(256).to(torch.uint8))
        yield made
    finally:
        made.close()


BOTH = pytest.mark.parametrize(
    "segment",
    [pytest.param("memfd", marks=needs_memfd), pytest.param("file")],
    indirect=True,
)


# --------------------------------------------------------------------------------------
# in this process: what the engine's plane maps
# --------------------------------------------------------------------------------------


@needs_memfd
@pytest.mark.parametrize("segment", ["memfd"], indirect=True)
def test_the_engine_maps_a_memfd_read_only_without_a_warning(segment: ShmSegment) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "buffer is not writable" would raise here
        plane = ShmReceiverPlane(ShmPlaneSpec([segment.handle]))
        view = plane.view(0, 256)
    try:
        assert view.tolist() == list(range(256))
        perms, path = mapping_of(view.data_ptr())
        assert perms == "r--s"
        assert segment.name.rsplit("-", 1)[1] in path  # the segment's own memfd
        assert mapping_of(segment.tensor.data_ptr())[0] == "rw-s"  # the trainer's stays
        segment.tensor[0] = 7  # the trainer refills its buffer; the engine sees it
        assert int(view[0]) == 7
    finally:
        del view
        plane.close()


@pytest.mark.parametrize("segment", ["file"], indirect=True)
def test_the_engine_reads_a_file_through_a_read_only_descriptor_into_its_own_memory(
    segment: ShmSegment,
) -> None:
    trainers = descriptor_flags(segment.name)  # its mmap's own descriptor
    plane = ShmReceiverPlane(ShmPlaneSpec([segment.handle]))
    try:
        view = plane.view(0, 256)
        assert view.tolist() == list(range(256))
        assert mapping_of(view.data_ptr())[0] == "rw-p"  # the engine's private copy
        engines = descriptor_flags(segment.name).items() - trainers.items()
        ((_, flags),) = engines  # the plane's one descriptor on it
        assert flags & os.O_ACCMODE == os.O_RDONLY
        view[0] = 99  # the engine's buffer, not the trainer's
        assert int(segment.tensor[0]) == 0
    finally:
        plane.close()


# --------------------------------------------------------------------------------------
# in another process: an engine that writes through its view
# --------------------------------------------------------------------------------------

WRITER = """
import json, sys
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.planes.shm import ShmReceiverPlane

name, size = json.loads(sys.argv[1])
plane = ShmReceiverPlane(ShmPlaneSpec([ShmHandle(name, size)]))
view = plane.view(0, 16)
print(json.dumps({"read": view[:4].tolist()}), flush=True)
view[0] = 99
print(json.dumps({"wrote": int(view[0])}), flush=True)
"""


@BOTH
def test_a_write_through_an_engines_view_never_reaches_the_trainer(segment: ShmSegment) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", "-c", WRITER, json.dumps([segment.name, SIZE])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
        proc.wait()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0] == {"read": [0, 1, 2, 3]}, err
    if segment.backend == "memfd":
        assert proc.returncode == -signal.SIGSEGV, err  # the page is not writable
        assert len(lines) == 1
    else:
        assert proc.returncode == 0, err
        assert lines[1] == {"wrote": 99}  # into the engine's own copy
    assert segment.tensor[:4].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------
# the creator's write seal
# --------------------------------------------------------------------------------------


@needs_memfd
def test_a_sender_planes_memfd_can_change_only_through_the_trainers_view() -> None:
    if not future_write_sealable():
        pytest.skip("F_SEAL_FUTURE_WRITE needs Linux 5.1")
    sender = ShmSenderPlane(1, SIZE, backend="memfd")
    receiver = ShmReceiverPlane(sender.spec)
    try:
        (handle,) = sender.spec.buffers
        with pytest.raises(AiosyncError, match="sealed against writing"):
            ShmSegment.attach(handle)  # writable: refused
        _, _, pid, number, _ = handle.name.rsplit("-", 4)
        fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR)  # what a hostile peer could do
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
        finally:
            os.close(fd)
        for value in (5, 6):  # the trainer itself refills the buffer, version after version
            sender._segments[0].tensor[:8] = value
            assert receiver.view(0, 8).tolist() == [value] * 8
    finally:
        receiver.close()
        sender.close()


# --------------------------------------------------------------------------------------
# the weight server's subscribers
# --------------------------------------------------------------------------------------


class MappingProbe(ModuleSink):
    """A sink that records the permissions of the mapping every bucket it gets lies in."""

    def __init__(self, target: dict[str, torch.Tensor]) -> None:
        super().__init__(target)
        self.seen: list[tuple[str, str]] = []

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.seen.append(mapping_of(bucket.data_ptr()))
        super().apply_bucket(bucket, specs)


@needs_memfd
async def test_a_server_subscriber_maps_retained_versions_read_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOSYNC_SHM_BACKEND", raising=False)
    weights = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(70_000)}
    held = {name: torch.zeros_like(t) for name, t in weights.items()}
    probe = MappingProbe(held)
    config = SenderConfig(buffer_bytes=64 << 10, num_buffers=2, timeout=WAIT)
    with anyio.fail_after(2 * WAIT):
        async with (
            WeightServer(ServerConfig(timeout=WAIT)) as server,
            Subscriber(server.control_endpoint, probe, name="e"),
            WeightSender(server.publish_endpoint, config=config) as sender,
        ):
            await sender.send(weights, version=1)
            await server.wait_for(1, WAIT)
            assert server.store.versions == [1]
    assert all(torch.equal(held[k], weights[k]) for k in weights)
    assert len(probe.seen) >= 2  # "b" spans buckets
    for perms, path in probe.seen:
        assert perms == "r--s", path
        assert path.startswith("/memfd:aiosync-")
