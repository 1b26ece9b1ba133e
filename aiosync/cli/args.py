"""The command line's arguments: the parser, one check per value, and ``--device auto``.

Every value is checked by argparse itself (a ``type=`` function per kind of number, size,
port or address), so a bad one ends with the usage and a one-line error, never a traceback.
``--log-level`` is accepted before or after the subcommand. Building the parser imports no
torch, so ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from aiosync import __version__
from aiosync.cli.checks import (
    LOG_LEVELS,
    bind_endpoint,
    connect_endpoint,
    device_name,
    log_level,
    non_negative_int,
    positive_float,
    positive_int,
    size_mib,
    size_mib_int,
)

DESCRIPTION = """\
Stream model weights from a trainer process to an inference engine process.

demo   starts an engine and a trainer on this machine, streams a synthetic
       Llama-shaped model for several versions and checks each one bit-exact.
bench  measures that stream against a single-threaded memcpy and the simple
       ways weights are moved today (torch.save over ZMQ, safetensors in /dev/shm).
engine, trainer
       the two sides on their own, as demo and bench run them; they report
       JSON lines on stdout.
keygen writes a CURVE keypair, which tcp:// endpoints need.
serve  runs a weight server: trainers publish, engines subscribe (docs/server.md).
"""


# --- the parser ------------------------------------------------------------------------------


class _Help(argparse.HelpFormatter):
    """Adds "(default: ...)" to the help of options that have a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class _MainHelp(argparse.RawDescriptionHelpFormatter, _Help):
    """Also keeps the main description's own line breaks."""


def _log_level_option(parser: argparse.ArgumentParser, *, default: Any) -> None:
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=default,
        metavar="LEVEL",
        help=f"logging on stderr: {', '.join(LOG_LEVELS)}, any case; also after the subcommand",
    )


def _subparser(sub: Any, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=description, formatter_class=_Help
    )
    # The main parser holds the default; here SUPPRESS leaves its value alone unless given.
    _log_level_option(parser, default=argparse.SUPPRESS)
    return parser


def _model(parser: argparse.ArgumentParser, *, timeout_help: str) -> None:
    parser.add_argument(
        "--size-mb", type=size_mib_int, default=1024, metavar="MIB", help="model size in MiB"
    )
    parser.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="auto (cuda:0 when CUDA is available, else cpu), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0, metavar="SECONDS", help=timeout_help
    )
    parser.add_argument(
        "--tensors",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="stream N one-element tensors instead of the Llama-shaped model (0: Llama)",
    )


def _keys(parser: argparse.ArgumentParser, *, binds: bool) -> None:
    parser.add_argument(
        "--keypair",
        metavar="FILE",
        help="this side's CURVE secret key file (from aiosync keygen); tcp:// needs keys",
    )
    if binds:
        parser.add_argument(
            "--allow",
            metavar="PATH",
            help="public key file, or directory of them, of the trainers let in",
        )
    else:
        parser.add_argument("--server-key", metavar="FILE", help="the engine's public key file")
    parser.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="allow plain tcp on 127.0.0.1 without keys (any local user can then connect)",
    )


def _buffers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--buffers", type=positive_int, default=2, help="shared buffers the trainer fills in turn"
    )
    parser.add_argument(
        "--buffer-mb",
        type=size_mib,
        default=128.0,
        metavar="MIB",
        help="size of each shared buffer in MiB (fractions allowed)",
    )


def _report(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as one JSON object on the last line"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


PEER_WAIT = "seconds to wait on the other process at each step"


Command = Callable[[argparse.Namespace], int]


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    """The ``aiosync`` parser; ``commands`` maps each subcommand to the function that runs it."""
    parser = argparse.ArgumentParser(
        prog="aiosync", description=DESCRIPTION, formatter_class=_MainHelp
    )
    _log_level_option(parser, default="WARNING")
    parser.add_argument("--version", action="version", version=f"aiosync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _subparser(
        sub,
        "demo",
        "stream a synthetic model trainer -> engine and check every version",
        "Start an engine and a trainer process, stream a synthetic model for several versions "
        "and check each one bit-exact on the engine.",
    )
    _model(demo, timeout_help=PEER_WAIT)
    _buffers(demo)
    demo.add_argument("--versions", type=positive_int, default=3, help="versions to stream")
    _report(demo, "a summary")

    bench = _subparser(
        sub,
        "bench",
        "measure the stream against memcpy and the simple ways",
        "Measure the trainer -> engine stream against a single-threaded memcpy and the "
        "simple ways of moving weights.",
    )
    _model(bench, timeout_help=PEER_WAIT)
    _buffers(bench)
    bench.add_argument(
        "--repeats", type=positive_int, default=3, help="timed versions (after one warm-up)"
    )
    bench.add_argument("--skip-baselines", action="store_true", help="measure aiosync only")
    bench.add_argument(
        "--engines",
        type=positive_int,
        default=1,
        help="also stream to this many engine processes at once and compare with one",
    )
    bench.add_argument(
        "--per-tensor",
        type=non_negative_int,
        default=100_000,
        metavar="N",
        help="also time N one-element tensors, per tensor (0: skip)",
    )
    bench.add_argument(
        "--serving",
        action="store_true",
        help="instead, measure serving under a steady request load while versions arrive "
        "(in place, staged copy, staged pointer): time to live, request waits, extra memory",
    )
    bench.add_argument(
        "--requests", type=positive_int, default=4, help="with --serving: request workers"
    )
    bench.add_argument(
        "--request-ms",
        type=positive_float,
        default=5.0,
        metavar="MS",
        help="with --serving: how long each request holds its read lease",
    )
    _report(bench, "every figure")

    trainer = _subparser(
        sub,
        "trainer",
        "run the trainer side alone (JSON lines on stdout)",
        "Send a synthetic model to an engine, one version after another, changing every "
        "weight between versions as a training step would.",
    )
    trainer.add_argument(
        "--endpoint",
        type=connect_endpoint,
        required=True,
        action="append",
        help="an engine's address (ipc:// or tcp://); repeat it to feed several engines",
    )
    trainer.add_argument(
        "--versions", type=non_negative_int, default=3, help="versions to send; 0: until stopped"
    )
    _model(trainer, timeout_help=PEER_WAIT)
    _buffers(trainer)
    _keys(trainer, binds=False)

    engine = _subparser(
        sub,
        "engine",
        "run the engine side alone (JSON lines on stdout)",
        "Receive versions of a synthetic model from trainers. Exits 1 with a one-line "
        "message when the next version does not arrive within --timeout.",
    )
    engine.add_argument(
        "--endpoint",
        type=bind_endpoint,
        help="address to bind (ipc:// or tcp://); default: a socket in a new private directory",
    )
    engine.add_argument(
        "--versions",
        type=non_negative_int,
        default=3,
        help="versions to receive before exiting; 0: serve until stopped, with no time limit",
    )
    _model(
        engine,
        timeout_help="seconds to wait for each version: the first from start, each next one "
        "from the one before",
    )
    engine.add_argument(
        "--verify", action="store_true", help="repeat the trainer's steps and check each version"
    )
    _keys(engine, binds=True)

    keygen = _subparser(
        sub,
        "keygen",
        "write a CURVE keypair for tcp:// endpoints",
        "Write DIR/NAME.key (the public key, for the other side) and DIR/NAME.key_secret "
        "(both keys, mode 0600). Existing files are never overwritten.",
    )
    keygen.add_argument("directory", metavar="DIR", help="where to write (created, mode 0700)")
    keygen.add_argument("--name", default="aiosync", help="file name of the keys, no suffix")

    serve = _subparser(
        sub,
        "serve",
        "run a weight server: trainers publish versions, engines subscribe",
        "Retain published versions in shared memory and stream the newest to every "
        "subscribed engine, late joiners included. Prints a ready line (JSON) with the "
        "endpoints; runs until SIGTERM or Ctrl-C.",
    )
    from aiosync.cli.serve import add_serve_arguments

    add_serve_arguments(serve)

    for name, command in commands.items():
        sub.choices[name].set_defaults(func=command)
    return parser
