"""The command line's conventions: --version, --help without torch, one-line errors for ports
and sizes (issue 25, item 9)."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import aiosync
from aiosync.cli import _commands, main
from aiosync.cli.args import build_parser
from aiosync.cli.checks import MAX_MIB, MiB, model_size_problem
from aiosync.runtime import child_env

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = sorted(_commands())


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def aiosync_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosync", *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- --version and --help, without torch -----------------------------------------------------


def test_version_prints_the_package_version() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = aiosync_command("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"aiosync {declared}\n"
    assert out.stderr == ""


def test_every_subcommand_is_covered() -> None:
    assert set(COMMANDS) == {"demo", "bench", "trainer", "engine", "keygen", "serve"}


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], *([name, "--help"] for name in COMMANDS)],
    ids=lambda argv: " ".join(argv),
)
def test_help_and_version_do_not_import_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from aiosync.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exit_:\n"
        "    status = exit_.code\n"
        "print(status, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    out = python(code)
    assert out.returncode == 0, out.stderr
    assert out.stderr.split() == ["0", "False"], out.stderr
    assert "usage: aiosync" in out.stdout or out.stdout.startswith("aiosync ")


def test_import_aiosync_does_not_import_torch() -> None:
    out = python("import sys, aiosync; print(aiosync.__version__, 'torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [aiosync.__version__, "False"]


def test_a_lazy_name_imports_its_module_on_first_use() -> None:
    out = python(
        "import sys, aiosync\n"
        "before = 'aiosync.trainer.sender' in sys.modules\n"
        "from aiosync import WeightSender\n"
        "print(before, WeightSender.__module__, 'torch' in sys.modules)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "aiosync.trainer.sender", "True"]


def test_every_public_name_resolves_to_its_defining_object() -> None:
    origins = aiosync._ORIGINS
    assert {name for names in origins.values() for name in names} == set(aiosync.__all__) - {
        "__version__"
    }
    for module, names in origins.items():
        for name in names:
            assert getattr(aiosync, name) is getattr(importlib.import_module(module), name), name
    namespace: dict[str, object] = {}
    exec("from aiosync import *", namespace)
    assert set(aiosync.__all__) <= set(namespace)
    assert set(aiosync.__all__) <= set(dir(aiosync))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'WeightSenders'"):
        _ = aiosync.WeightSenders  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from aiosync import WeightSenders", {})


# --- ports, addresses and sizes: one error line, status 2 ------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--metrics-port", "99999"],
        ["serve", "--metrics-port", "-1"],
        ["serve", "--retain-mb", "inf"],
        ["serve", "--publish", "tcp://127.0.0.1:65536"],
        ["serve", "--control", "tcp://127.0.0.1"],
        ["serve", "--upstream", "tcp://127.0.0.1:0"],
        ["demo", "--buffer-mb", "inf"],
        ["bench", "--buffer-mb", "1e300"],
        ["demo", "--size-mb", str(MAX_MIB + 1)],
        ["engine", "--endpoint", "tcp://127.0.0.1:99999"],
        ["engine", "--endpoint", "engine.sock"],
        ["trainer", "--endpoint", "tcp://127.0.0.1:0"],
        ["trainer", "--endpoint", "tcp://127.0.0.1:http"],
        ["trainer", "--endpoint", "tcp://127.0.0.1:\u00b2"],
    ],
)
def test_bad_ports_addresses_and_sizes_end_with_one_error_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert errors == [err.splitlines()[-1]], err
    assert f"argument {argv[-2]}: " in errors[0]


@pytest.mark.parametrize(
    ("argv", "attribute", "value"),
    [
        (["serve", "--metrics-port", "0"], "metrics_port", 0),
        (["serve", "--metrics-port", "65535"], "metrics_port", 65535),
        (["serve", "--publish", "tcp://*:0"], "publish", "tcp://*:0"),
        (["serve", "--control", "tcp://127.0.0.1:*"], "control", "tcp://127.0.0.1:*"),
        (["serve", "--control", "tcp://[::1]:5555"], "control", "tcp://[::1]:5555"),
        (["serve", "--retain-mb", "0.5"], "retain_mb", 0.5),
        (["engine", "--endpoint", "ipc:///tmp/x.sock"], "endpoint", "ipc:///tmp/x.sock"),
        (["trainer", "--endpoint", "tcp://10.0.0.1:65535"], "endpoint", ["tcp://10.0.0.1:65535"]),
        (["demo", "--size-mb", str(MAX_MIB)], "size_mb", MAX_MIB),
    ],
)
def test_good_ports_addresses_and_sizes_pass(
    argv: list[str], attribute: str, value: object
) -> None:
    args = build_parser(dict.fromkeys(COMMANDS, lambda args: 0)).parse_args(argv)
    assert getattr(args, attribute) == value


def test_a_model_larger_than_the_machine_is_refused_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--device", "cpu", "--size-mb", str(MAX_MIB)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith("of this machine's memory"), err
    assert f"argument --size-mb: a {MAX_MIB} MiB model does not fit in the " in err


def test_model_size_problem() -> None:
    assert model_size_problem(1024, 1024 * MiB, "here") is None
    assert model_size_problem(1025, 1024 * MiB, "cuda:0's memory") == (
        "a 1025 MiB model does not fit in the 1024 MiB of cuda:0's memory"
    )


def test_metrics_port_out_of_range_from_the_shell_is_no_traceback() -> None:
    out = aiosync_command("serve", "--metrics-port", "99999")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "aiosync serve: error: argument --metrics-port: must be a port from 0 to 65535, got 99999"
    )
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


def test_a_metrics_port_in_use_is_one_line_and_status_2() -> None:
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = aiosync_command("serve", "--metrics-port", str(port))
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"aiosync serve: error: argument --metrics-port: the metrics endpoint cannot listen on "
        f"127.0.0.1:{port}: Address already in use"
    ]
    assert not [line for line in out.stdout.splitlines() if json.loads(line)["event"] == "ready"]


def test_the_library_names_the_metrics_address_it_cannot_take() -> None:
    pytest.importorskip("prometheus_client")
    from aiosync.server.metrics import MetricsAddressError, MetricsEndpoint, ServerMetrics

    def health() -> tuple[bool, dict[str, object]]:
        return True, {}

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsAddressError, match=f"127.0.0.1:{port}: Address already in use"):
            MetricsEndpoint(ServerMetrics(), health, port=port)
    with pytest.raises(MetricsAddressError, match="metrics port 99999 is not from 0 to 65535"):
        MetricsEndpoint(ServerMetrics(), health, port=99999)
