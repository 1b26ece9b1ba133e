"""A resume directory is opened once and used only through its descriptor (issue 26, item 3).

:class:`~aiosync.engine.held.HeldBuckets` checks the directory on the descriptor it opens
(``O_DIRECTORY | O_NOFOLLOW``, ``fstat``) and reaches every file relative to it, so a
directory swapped for a symlink after the check never receives a file. A directory, FIFO
or symlink planted under a bucket's name or a ``.part`` name is skipped and reported,
never fatal: the engine starts and ends with the right weights. Closing the store (or
dropping it) closes the directory's descriptor.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import anyio
import pytest
import torch

from aiosync import ModuleSink, SenderConfig, WeightSender
from aiosync.core.errors import AiosyncError
from aiosync.engine.held import HeldBuckets, bucket_digest
from aiosync.server import ServerConfig, Subscriber, WeightServer
from tests.api.test_server import empty, model, same
from tests.api.test_server_resume import buckets_of

WAIT = 60.0
KINDS = {"directory": "a directory", "fifo": "a FIFO", "symlink": "a symbolic link"}


def bucket(seed: int, size: int = 1000) -> tuple[bytes, torch.Tensor]:
    data = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return bucket_digest(data), data


def open_fds() -> set[str]:
    """What this process's descriptors point at (to see one left open)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue  # the listing's own descriptor
    return found


def plant(path: Path, kind: str, target: Path) -> None:
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"keep")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(target)


# --- a symlink swapped in after the check -------------------------------------------------


def test_a_directory_moved_and_replaced_by_a_symlink_gets_no_file_through_it(
    tmp_path: Path,
) -> None:
    directory, elsewhere = tmp_path / "resume", tmp_path / "only-root-writes-here"
    elsewhere.mkdir()
    (d0, b0), (d1, b1) = bucket(0), bucket(1)
    (elsewhere / d1.hex()).write_bytes(bytes(1000))  # a bucket's name, not ours
    store = HeldBuckets(directory, memory=False)
    assert store.put(0, d0, b0)
    directory.rename(tmp_path / "moved")  # between the check and the writes
    directory.symlink_to(elsewhere)
    assert store.put(0, d1, b1)
    taken = store.take(0, d0, 1000)
    assert taken is not None
    assert torch.equal(taken, b0)
    store.clear()
    store.close()
    assert sorted(p.name for p in elsewhere.iterdir()) == [d1.hex()]  # nothing written there
    assert (elsewhere / d1.hex()).read_bytes() == bytes(1000)  # nor removed
    assert list((tmp_path / "moved").iterdir()) == []  # every file went to the checked one


def test_a_directory_removed_and_replaced_by_a_symlink_gets_nothing(tmp_path: Path) -> None:
    directory, elsewhere = tmp_path / "resume", tmp_path / "only-root-writes-here"
    elsewhere.mkdir()
    (d0, b0), (d1, b1) = bucket(0), bucket(1)
    with HeldBuckets(directory, memory=False) as store:
        assert store.put(0, d0, b0)
        (directory / d0.hex()).unlink()
        directory.rmdir()
        directory.symlink_to(elsewhere)
        assert not store.put(0, d1, b1)  # the checked directory is gone: not kept, no error
        assert store.take(0, d0, 1000) is None
        store.clear()
    assert list(elsewhere.iterdir()) == []


def test_a_symlink_or_a_file_at_the_path_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(
        AiosyncError, match=r"link must be a directory of this user, 0700 \(it is a symlink"
    ):
        HeldBuckets(tmp_path / "link")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(AiosyncError, match=r"file must be a directory of this user"):
        HeldBuckets(tmp_path / "file")


# --- entries of the wrong type -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
@pytest.mark.parametrize("suffix", ["", ".part"])
def test_a_planted_entry_is_skipped_and_reported_never_fatal(
    tmp_path: Path, kind: str, suffix: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory, target = tmp_path / "resume", tmp_path / "target"
    directory.mkdir(mode=0o700)
    target.write_bytes(bytes(1000))
    (d0, b0), (d1, b1) = bucket(0), bucket(1)
    name = d0.hex() + suffix
    plant(directory / name, kind, target)
    caplog.set_level(logging.WARNING)
    with HeldBuckets(directory, memory=False) as store:  # starts
        assert store.digests() == []  # never counted as held
        assert store.skipped == {name: KINDS[kind]}
        assert f"{name} is {KINDS[kind]}, not a bucket file; skipped" in caplog.text
        kept = store.put(0, d0, b0)
        assert kept is (kind != "directory")  # a directory there is left, so no file
        assert store.put(0, d1, b1)  # other buckets are unaffected
        taken = store.take(0, d1, 1000)
        assert taken is not None
        assert torch.equal(taken, b1)
        store.clear()
    assert target.read_bytes() == bytes(1000)  # never followed
    left = sorted(p.name for p in directory.iterdir())
    assert left == ([name] if kind == "directory" else [])  # a directory is left alone
    if kind == "directory":
        assert (directory / name / "inside").read_bytes() == b"keep"


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_part_entry_planted_after_open_is_not_written_through(tmp_path: Path, kind: str) -> None:
    directory, target = tmp_path / "resume", tmp_path / "target"
    target.write_bytes(b"outside")
    d0, b0 = bucket(0)
    with HeldBuckets(directory, memory=True) as store:
        plant(directory / (d0.hex() + ".part"), kind, target)
        assert store.put(0, d0, b0)  # in memory at least
        on_disk = (directory / d0.hex()).exists()
        assert on_disk is (kind != "directory")
        assert store.skipped == {d0.hex() + ".part": KINDS[kind]}
        taken = store.take(0, d0, 1000)
        assert taken is not None
        assert torch.equal(taken, b0)
    assert target.read_bytes() == b"outside"


def test_a_planted_bucket_directory_does_not_stop_an_engine(tmp_path: Path) -> None:
    directory = tmp_path / "resume"
    directory.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not weights")

    digests: list[str] = []

    async def main() -> None:
        config = SenderConfig(buffer_bytes=64 << 10, num_buffers=2, timeout=WAIT)
        async with (
            WeightServer(ServerConfig(timeout=WAIT)) as server,
            WeightSender(server.publish_endpoint, config=config) as sender,
        ):
            await sender.send(model(0), version=0)
            digests.extend(digest.hex() for digest, _ in buckets_of(server, 0))
            assert len(digests) >= 4
            (directory / digests[0]).mkdir()
            (directory / (digests[1] + ".part")).mkdir()
            os.mkfifo(directory / digests[2])
            (directory / (digests[3] + ".part")).symlink_to(outside)
            there = empty()
            sub = Subscriber(
                server.control_endpoint, ModuleSink(there), name="e", resume_dir=directory
            )
            async with sub:
                assert await sub.wait_for_version(0, WAIT) == 0
                assert sub.held is not None
                assert set(sub.held.skipped) == {
                    digests[0],
                    digests[1] + ".part",
                    digests[2],
                    digests[3] + ".part",
                }
            assert same(there, model(0))
            sub.held.close()

    anyio.run(main)
    assert outside.read_bytes() == b"not weights"
    planted = {p.name for p in directory.iterdir()}
    assert planted == {digests[0], digests[1] + ".part"}  # the directories; the rest gone


# --- descriptors ---------------------------------------------------------------------------


def test_no_descriptor_is_left_open(tmp_path: Path) -> None:
    gc.collect()  # descriptors that earlier tests left in cycles close now, not mid-test
    before = open_fds()
    (d0, b0), (d1, b1) = bucket(0), bucket(1)
    store = HeldBuckets(tmp_path / "resume", memory=False)
    assert any(str(tmp_path / "resume") in fd for fd in open_fds() - before)  # held open
    assert store.put(0, d0, b0)
    assert store.take(0, d0, 1000) is not None
    assert store.take(0, d1, 1000) is None
    store.clear()
    store.close()
    store.close()  # idempotent
    assert open_fds() == before
    assert not store.put(0, d1, b1)  # closed, only a directory: not kept, no error
    assert store.take(0, d1, 1000) is None
    store.clear()

    dropped = HeldBuckets(tmp_path / "resume")  # never closed: dropping it closes it
    assert dropped.put(0, d1, b1)
    del dropped
    gc.collect()
    assert open_fds() == before

    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(AiosyncError, match="mode 777"):
        HeldBuckets(tmp_path / "open")
    assert open_fds() == before  # a refused directory is not left open


def test_after_close_memory_still_serves(tmp_path: Path) -> None:
    d0, b0 = bucket(0)
    store = HeldBuckets(tmp_path / "resume", memory=True)
    assert store.put(0, d0, b0)
    store.close()
    taken = store.take(0, d0, 1000)
    assert taken is not None
    assert torch.equal(taken, b0)
    assert (tmp_path / "resume" / d0.hex()).exists()  # the file stays for the next process
    again = HeldBuckets(tmp_path / "resume", memory=False)
    assert again.digests() == [d0]
    again.close()
