"""The `aiosync` command as a user runs it (small sizes; no timing is asserted)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aiosync.cli import main
from aiosync.cli.args import build_parser
from aiosync.cli.checks import resolve_device
from aiosync.private_dirs import creator_pid
from aiosync.runtime import child_env


def aiosync(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosync", *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "aiosync", *argv],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def last_json(stdout: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def parse(*argv: str) -> argparse.Namespace:
    commands = dict.fromkeys(("demo", "bench", "trainer", "engine"), lambda args: 0)
    return build_parser(commands).parse_args(argv)


def private_dirs_of(pid: int) -> list[Path]:
    import tempfile

    return [p for p in Path(tempfile.gettempdir()).glob("aiosync-*") if creator_pid(p) == pid]


# --- demo and bench ------------------------------------------------------------------------


def test_demo_verifies_every_version_and_reports_json() -> None:
    out = aiosync("demo", "--device", "cpu", "--size-mb", "16", "--versions", "3", "--json")
    assert out.returncode == 0, out.stderr
    summary = last_json(out.stdout)
    assert summary["ok"] is True
    assert summary["versions_verified"] == [0, 1, 2]
    assert summary["bytes_per_version"] > 15 * 2**20
    assert len(summary["seconds"]) == 3
    assert "version 2" in out.stderr  # progress was shown
    assert " INFO " not in out.stderr  # the default level is WARNING, in the children too


def test_bench_prints_one_json_object_last_with_every_figure() -> None:
    out = aiosync(
        "bench", "--device", "cpu", "--size-mb", "16", "--repeats", "1", "--json",
        "--engines", "2", "--per-tensor", "3000",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = last_json(out.stdout)
    for key in ("bytes", "seconds", "GBps", "memcpy_GBps", "trainer_seconds", "engine_seconds"):
        assert result[key] > 0, key
    assert result["one_engine"]["engines"] == 1
    assert result["one_engine"]["ratio_to_floor"] > 0
    many = result["many_engines"]
    assert many["engines"] == 2
    assert many["bytes"] == result["bytes"]
    assert many["ratio_to_one_engine"] > 0
    per_tensor = result["per_tensor"]
    assert per_tensor["tensors"] == 3000
    assert per_tensor["us_per_tensor"] > 0
    for case in (result["one_engine"], many, per_tensor):
        assert case["trainer_stall_ms"] > 0
        assert case["engine_stall_ms"] > 0
    for baseline in ("torch_save_zmq", "safetensors_shm"):
        assert result[baseline]["verified"] is True
        assert result[baseline]["seconds"] > 0


def test_demo_log_level_after_the_command_reaches_both_children() -> None:
    out = aiosync("demo", "--size-mb", "4", "--versions", "2", "--json", "--log-level", "info")
    assert out.returncode == 0, out.stderr
    assert last_json(out.stdout)["ok"] is True
    lines = out.stderr.splitlines()
    for role in ("engine", "trainer"):
        # the library's own records (not only the command's), tagged with the process's role
        library = [line for line in lines if f"[{role}] aiosync." in line and " INFO " in line]
        assert any("aiosync.cli" not in line for line in library), (role, out.stderr)
    assert any("committed version 1" in line for line in lines), out.stderr


def test_demo_fails_cleanly_when_the_trainer_cannot_run() -> None:
    # A buffer below the sender's minimum makes the trainer refuse its configuration at start.
    out = aiosync("demo", "--device", "cpu", "--size-mb", "8", "--buffer-mb", "0.0001", "--json")
    assert out.returncode == 1
    summary = last_json(out.stdout)
    assert summary["ok"] is False
    assert summary["versions_verified"] == []
    assert "buffer_bytes must be at least" in out.stderr
    assert "Traceback" not in out.stderr  # one line from the trainer, not a stack


# --- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--size-mb", "lots"],
        ["demo", "--size-mb", "0"],
        ["demo", "--versions", "0"],
        ["demo", "--versions", "-1"],
        ["demo", "--buffers", "0"],
        ["demo", "--buffer-mb", "0"],
        ["demo", "--buffer-mb", "-2"],
        ["demo", "--timeout", "0"],
        ["demo", "--timeout", "nan"],
        ["bench", "--repeats", "0"],
        ["bench", "--buffers", "2.5"],
        ["engine", "--versions", "-1"],
        ["engine", "--timeout", "-5"],
        ["trainer", "--endpoint", "ipc:///x", "--versions", "many"],
        ["demo", "--device", "gpu"],
        ["demo", "--log-level", "loud"],
        ["--log-level", "verbose", "demo"],
    ],
)
def test_bad_values_end_with_usage_and_one_error_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: aiosync")
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    assert errors[0] == err.splitlines()[-1], err
    assert argv[-2] in errors[0]  # names the option


def test_bad_value_from_the_shell_is_no_traceback() -> None:
    out = aiosync("demo", "--size-mb", "lots")
    assert out.returncode == 2
    assert "argument --size-mb: 'lots' is not an integer" in out.stderr
    assert "Traceback" not in out.stderr


def test_roles_accept_zero_versions_meaning_forever() -> None:
    assert parse("engine", "--versions", "0").versions == 0
    assert parse("trainer", "--endpoint", "ipc:///x", "--versions", "0").versions == 0


def test_log_level_before_or_after_the_command_in_any_case() -> None:
    assert parse("demo").log_level == "WARNING"
    assert parse("--log-level", "debug", "demo").log_level == "DEBUG"
    assert parse("demo", "--log-level", "Info").log_level == "INFO"
    assert parse("engine", "--log-level", "error").log_level == "ERROR"
    assert parse("--log-level", "debug", "bench", "--log-level", "error").log_level == "ERROR"


def test_help_is_plain_text_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["demo"], ["bench"], ["engine"], ["trainer"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        text = capsys.readouterr().out
        for markup in ("``", ":class:", ":func:", ":mod:"):
            assert markup not in text, (argv, markup)
        if argv:
            assert "(default: 1024)" in text  # --size-mb
            assert "(default: auto)" in text  # --device
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(default: 128.0)" in capsys.readouterr().out  # --buffer-mb


def test_device_auto_resolves_to_a_concrete_device() -> None:
    device = resolve_device("auto")
    assert device == "cpu" or device.startswith("cuda:")
    assert resolve_device("cpu") == "cpu"
    for argv in (["demo"], ["bench"], ["engine"], ["trainer", "--endpoint", "ipc:///x"]):
        assert parse(*argv).device == "auto"


def test_trainer_takes_several_engines() -> None:
    args = parse("trainer", "--endpoint", "ipc:///a", "--endpoint", "ipc:///b")
    assert args.endpoint == ["ipc:///a", "ipc:///b"]


# --- the roles -----------------------------------------------------------------------------


def test_engine_and_trainer_roles_with_device_auto() -> None:
    """The roles on their own, with every option at its default but sizes and versions."""
    engine = start("engine", "--size-mb", "2", "--versions", "2", "--verify")
    try:
        assert engine.stdout is not None
        ready = json.loads(engine.stdout.readline())
        assert ready["event"] == "ready", engine.stderr.read() if engine.stderr else ""
        trainer = aiosync(
            "trainer", "--endpoint", ready["endpoint"], "--size-mb", "2", "--versions", "2"
        )
        assert trainer.returncode == 0, trainer.stderr
        assert [e["version"] for e in map(json.loads, trainer.stdout.splitlines())
                if e["event"] == "synced"] == [0, 1]  # fmt: skip
        out, err = engine.communicate(timeout=60)
        assert engine.returncode == 0, err
        committed = [json.loads(line) for line in out.splitlines()]
        assert [(e["version"], e["verified"]) for e in committed] == [(0, True), (1, True)]
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.communicate()
    assert not private_dirs_of(engine.pid)


def test_engine_without_a_trainer_says_what_it_waited_for() -> None:
    out = aiosync("engine", "--size-mb", "1", "--timeout", "1.5", timeout=120)
    assert out.returncode == 1
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["event"] for e in events] == ["ready", "timeout"]
    endpoint = events[0]["endpoint"]
    message = f"engine at {endpoint}: no version 0 from any trainer within 1.5s"
    assert events[1]["message"] == message
    assert out.stderr.strip().splitlines()[-1] == f"aiosync engine: {message}"
    assert "Traceback" not in out.stderr
    assert not Path(endpoint.removeprefix("ipc://")).parent.exists()


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)]
)
def test_a_signalled_engine_removes_its_private_dir(signum: int, status: int) -> None:
    engine = start("engine", "--device", "cpu", "--size-mb", "1", "--versions", "0")
    try:
        assert engine.stdout is not None
        ready = json.loads(engine.stdout.readline())
        directory = Path(ready["endpoint"].removeprefix("ipc://")).parent
        assert directory.is_dir()
        engine.send_signal(signum)
        _, err = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.communicate()
    assert engine.returncode == status, err
    assert "Traceback" not in err
    assert not directory.exists()
    assert not private_dirs_of(engine.pid)


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def test_sigterm_to_demo_stops_both_children_and_removes_the_dir() -> None:
    demo = start("demo", "--device", "cpu", "--size-mb", "2", "--versions", "100000", "--quiet")
    try:
        deadline = time.monotonic() + 120
        while len(children_of(demo.pid)) < 2 or not private_dirs_of(demo.pid):
            assert demo.poll() is None, demo.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        children = children_of(demo.pid)
        commands = sorted(Path(f"/proc/{c}/cmdline").read_text().split("\0")[1:4] for c in children)
        assert commands == [["-m", "aiosync", "engine"], ["-m", "aiosync", "trainer"]]
        (directory,) = private_dirs_of(demo.pid)
        time.sleep(1)  # let the stream get going
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert not directory.exists()
    for child in children:  # stopped and reaped by the demo before it exited
        assert not Path(f"/proc/{child}").exists()
        assert not private_dirs_of(child)


def test_python_dash_m_aiosync_and_aiosync_cli_are_the_same_command() -> None:
    for module in ("aiosync", "aiosync.cli"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("usage: aiosync")


def test_roles_over_tcp_need_keys_and_stream_with_them(tmp_path: Path) -> None:
    """The engine binds tcp with its keypair and lets the trainer's key in; without keys the
    trainer is refused before it sends anything."""
    for name in ("engine", "trainer"):
        assert aiosync("keygen", str(tmp_path), "--name", name).returncode == 0
    plain = aiosync("trainer", "--endpoint", "tcp://127.0.0.1:1", "--size-mb", "1")
    assert plain.returncode != 0
    assert "tcp" in plain.stderr
    keys = {
        "--keypair": str(tmp_path / "engine.key_secret"),
        "--allow": str(tmp_path / "trainer.key"),
    }
    engine = start(
        "engine", "--endpoint", "tcp://127.0.0.1:0", "--size-mb", "2", "--versions", "2",
        "--verify", *[part for pair in keys.items() for part in pair],
    )  # fmt: skip
    try:
        assert engine.stdout is not None
        ready = json.loads(engine.stdout.readline())
        trainer = aiosync(
            "trainer", "--endpoint", ready["endpoint"], "--size-mb", "2", "--versions", "2",
            "--keypair", str(tmp_path / "trainer.key_secret"),
            "--server-key", str(tmp_path / "engine.key"),
        )  # fmt: skip
        assert trainer.returncode == 0, trainer.stderr
        assert engine.wait(timeout=60) == 0
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
