"""What every ``aiosync`` command shares: its one-line error and the checks of its values.

The argparse ``type=`` functions here turn a bad number, size, port, address, log level or
device into a one-line usage error; :func:`resolve_device` turns ``auto`` into a device this
machine has, and :func:`check_model_size` refuses a model that cannot fit on it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_MIB = 1 << 43
"""The largest size in MiB anywhere (2**63 bytes): above it no byte count fits an int64."""
MAX_PORT = 65535


class CommandError(Exception):
    """A failure the command reports as one line on stderr (exit status 1)."""

    status = 1


class OptionError(CommandError):
    """A command-line value that no ``type=`` check could judge alone (exit status 2).

    A model too large for the device, a port in use: its message names the option, as
    argparse's own errors do.
    """

    status = 2

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"argument {option}: {problem}")


# --- value checks (argparse ``type=`` functions) ---------------------------------------------


def _number(kind: Callable[[str], Any], text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
    if isinstance(value, float) and math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return value


def positive_int(text: str) -> int:
    """An integer above 0."""
    value: int = _number(int, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of 0 or more."""
    value: int = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A number above 0 (``inf`` allowed)."""
    value: float = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def size_mib(text: str) -> float:
    """A size in MiB above 0, finite and at most :data:`MAX_MIB` (fractions allowed)."""
    value: float = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    if value > MAX_MIB:  # inf too
        raise argparse.ArgumentTypeError(f"must be at most {MAX_MIB} MiB (2**63 bytes), got {text}")
    return value


def size_mib_int(text: str) -> int:
    """A whole number of MiB above 0 and at most :data:`MAX_MIB`."""
    value = positive_int(text)
    if value > MAX_MIB:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_MIB} MiB (2**63 bytes), got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    value: int = _number(int, text)
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to {MAX_PORT}, got {value}")
    return value


def _endpoint(text: str, *, binds: bool) -> str:
    scheme, sep, address = text.partition("://")
    if not sep or not scheme or not address:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address such as ipc:///path or tcp://host:port"
        )
    if scheme != "tcp":
        return text  # ipc:// paths and the rest are the channel's to judge
    destination = address.rpartition(";")[2]  # zmq's "source;destination" form
    host, colon, port = destination.rpartition(":")
    if not colon or not host:
        raise argparse.ArgumentTypeError(f"{text!r} has no port (tcp://host:port)")
    if binds and port == "*":
        return text
    lowest = 0 if binds else 1
    if not (port.isascii() and port.isdigit()) or not lowest <= int(port) <= MAX_PORT:
        what = "from 0 to 65535 (0 or *: any free port)" if binds else "from 1 to 65535"
        raise argparse.ArgumentTypeError(f"{text!r}: port {port!r} is not {what}")
    return text


def bind_endpoint(text: str) -> str:
    """An address to bind: ``scheme://...``; on ``tcp://`` a port of 0 to 65535 or ``*``.

    zmq itself takes a port above 65535 modulo 65536, binding another port than asked.
    """
    return _endpoint(text, binds=True)


def connect_endpoint(text: str) -> str:
    """An address to connect to: ``scheme://...``; on ``tcp://`` a port of 1 to 65535."""
    return _endpoint(text, binds=False)


def log_level(text: str) -> str:
    """A logging level name, in any case; returned in upper case."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level (choose from {', '.join(LOG_LEVELS)})"
        )
    return level


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device_name(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (checked against the machine later)."""
    name = text.strip().lower()
    if not _DEVICE.match(name):
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, cpu, cuda or cuda:N")
    return name


def resolve_device(name: str) -> str:
    """The concrete device for ``name``: ``auto`` is ``cuda:0`` when CUDA works, else ``cpu``.

    Raises :class:`CommandError` for a CUDA device this machine does not have.
    """
    import torch

    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not torch.cuda.is_available():
        raise CommandError(f"--device {name}: CUDA is not available on this machine")
    index = int(name.partition(":")[2] or torch.cuda.current_device())
    if index >= torch.cuda.device_count():
        raise CommandError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices"
        )
    return f"cuda:{index}"


def model_size_problem(size_mib: int, capacity: int, where: str) -> str | None:
    """Why a model of ``size_mib`` MiB cannot fit in ``capacity`` bytes of ``where``, or None."""
    if size_mib * MiB <= capacity:
        return None
    return f"a {size_mib} MiB model does not fit in the {capacity // MiB} MiB of {where}"


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


def check_model_size(size_mib: int, device: str) -> None:
    """Refuse (:class:`OptionError`) a ``--size-mb`` larger than the device's whole memory.

    ``device`` is resolved (``cpu`` or ``cuda:N``). One copy of the model larger than all of
    this machine's memory (or the GPU's) could never be built, only hang trying.
    """
    if device == "cpu":
        capacity, where = _host_memory(), "this machine's memory"
    else:
        import torch

        capacity = torch.cuda.get_device_properties(device).total_memory
        where = f"{device}'s memory"
    if capacity is None:
        return
    problem = model_size_problem(size_mib, capacity, where)
    if problem is not None:
        raise OptionError("--size-mb", problem)
