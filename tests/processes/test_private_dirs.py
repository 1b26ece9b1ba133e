"""Private directories: made 0700 with the creator's pid in the name; swept once it is dead."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aiosync.private_dirs import (
    creator_pid,
    make_private_dir,
    pid_namespace,
    sweep_stale_dirs,
)
from aiosync.runtime import child_env


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stale_name(pid: int, namespace: int | None = None, suffix: str = "abcd_123") -> str:
    ns = pid_namespace() if namespace is None else namespace
    return f"aiosync-{ns}-{pid}-{suffix}"


def test_made_for_this_user_only_and_named_for_this_process(tmp_path: Path) -> None:
    directory = make_private_dir(parent=tmp_path)
    info = directory.lstat()
    assert directory.parent == tmp_path
    assert stat.S_ISDIR(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    assert directory.name.startswith(f"aiosync-{pid_namespace()}-{os.getpid()}-")
    assert creator_pid(directory) == os.getpid()


def test_default_parent_is_the_temporary_directory() -> None:
    import tempfile

    directory = make_private_dir()
    try:
        assert directory.parent == Path(tempfile.gettempdir())
    finally:
        directory.rmdir()


def test_a_dead_process_dir_is_swept_with_its_contents(tmp_path: Path) -> None:
    stale = tmp_path / stale_name(dead_pid())
    (stale / "sub").mkdir(parents=True)
    (stale / "engine.sock").write_text("")
    assert sweep_stale_dirs(parent=tmp_path) == [stale.name]
    assert not stale.exists()


def test_making_a_dir_sweeps_first(tmp_path: Path) -> None:
    stale = tmp_path / stale_name(dead_pid())
    stale.mkdir()
    fresh = make_private_dir(parent=tmp_path)
    assert not stale.exists()
    assert fresh.exists()


def test_live_processes_other_namespaces_and_other_names_are_kept(tmp_path: Path) -> None:
    pid = dead_pid()
    kept = [
        tmp_path / stale_name(os.getpid()),  # alive: this process
        tmp_path / stale_name(os.getppid()),  # alive
        tmp_path / stale_name(pid, namespace=pid_namespace() + 1),  # another PID namespace
        tmp_path / f"aiosync-{pid_namespace()}-{pid}-too-long-suffix",  # not our name
        tmp_path / f"other-{pid_namespace()}-{pid}-abcd_123",
    ]
    for path in kept:
        path.mkdir()
    assert sweep_stale_dirs(parent=tmp_path) == []
    assert all(path.is_dir() for path in kept)


def test_another_users_dir_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / stale_name(dead_pid())
    stale.mkdir()
    if os.getuid() == 0:
        os.chown(stale, 65534, 65534)  # nobody
    else:  # seen from another user's point of view
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    assert sweep_stale_dirs(parent=tmp_path) == []
    assert stale.is_dir()


def test_symlinks_and_files_are_never_followed_or_removed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious").write_text("keep")
    link = tmp_path / stale_name(dead_pid())
    link.symlink_to(target, target_is_directory=True)
    plain = tmp_path / stale_name(dead_pid(), suffix="abcd_456")
    plain.write_text("")
    # A stale directory holding a symlink out: the link goes, what it points at stays.
    stale = tmp_path / stale_name(dead_pid(), suffix="abcd_789")
    stale.mkdir()
    (stale / "out").symlink_to(target, target_is_directory=True)
    assert sweep_stale_dirs(parent=tmp_path) == [stale.name]
    assert link.is_symlink()
    assert plain.is_file()
    assert (target / "precious").read_text() == "keep"


def test_planted_names_never_break_the_sweep_or_a_new_dir(tmp_path: Path) -> None:
    """Whatever is planted under a name like a stale directory's, the sweep removes none of
    it, raises nothing, and a new private directory is still made."""
    ns = pid_namespace()
    pid = dead_pid()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    planted: list[Path] = []

    def plant(name: str) -> Path:
        path = tmp_path / name
        planted.append(path)
        return path

    plant(stale_name(pid, suffix="file_001")).write_text("")  # a file, not a directory
    plant(stale_name(pid, suffix="link_001")).symlink_to(victim, target_is_directory=True)
    plant(stale_name(pid, suffix="dang_001")).symlink_to(tmp_path / "nowhere")
    os.mkfifo(plant(stale_name(pid, suffix="fifo_001")))
    plant(stale_name(os.getpid(), suffix="live_001")).mkdir()  # its creator is alive
    plant(f"aiosync-{ns}-{pid}-abcd_123\n").mkdir()  # whole name only: no trailing newline
    plant(f"aiosync-{ns}-{'9' * 200}-abcd_123").mkdir()  # a pid os.kill overflows on
    plant(f"aiosync-{ns}-{2**40}-abcd_123").mkdir()  # a pid os.kill cannot take
    plant(f"aiosync-{'9' * 25}-{pid}-abcd_123").mkdir()  # a namespace of too many digits
    other = plant(stale_name(pid, suffix="user_001"))
    other.mkdir()
    if os.geteuid() == 0:
        os.chown(other, 65534, 65534)  # nobody's
    else:
        other.rmdir()
        planted.remove(other)
    assert sweep_stale_dirs(parent=tmp_path) == []
    assert all(os.path.lexists(path) for path in planted)
    assert (victim / "precious").read_text() == "keep"
    fresh = make_private_dir(parent=tmp_path)
    assert fresh.is_dir()
    assert all(os.path.lexists(path) for path in planted)


def test_a_sweep_of_a_missing_or_unreadable_parent_is_a_no_op(tmp_path: Path) -> None:
    assert sweep_stale_dirs(parent=tmp_path / "missing") == []
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert sweep_stale_dirs(parent=not_a_dir) == []


def test_creator_pid_needs_the_whole_name() -> None:
    assert creator_pid(Path(stale_name(1234))) == 1234
    assert creator_pid(Path(stale_name(1234) + "\n")) is None
    assert creator_pid(Path("x" + stale_name(1234))) is None


def test_a_killed_engine_leaves_a_dir_that_the_next_one_sweeps() -> None:
    """SIGKILL gives a process no chance to clean up; the sweep does it afterwards."""
    engine = subprocess.Popen(
        [sys.executable, "-m", "aiosync", "engine", "--device", "cpu", "--size-mb", "1",
         "--versions", "0"],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert engine.stdout is not None
        ready = json.loads(engine.stdout.readline())
        directory = Path(ready["endpoint"].removeprefix("ipc://")).parent
        assert creator_pid(directory) == engine.pid
        engine.send_signal(signal.SIGKILL)
        engine.wait(timeout=30)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        if engine.stdout is not None:
            engine.stdout.close()
    assert directory.is_dir()  # killed outright: left behind
    assert directory.name in sweep_stale_dirs()
    assert not directory.exists()
