"""What every ``aiosync`` command shares: its one-line error and the checks of its values.

The argparse ``type=`` functions here turn a bad number, log level or device into a one-line
usage error; :func:`resolve_device` turns ``auto`` into a device this machine has.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class CommandError(Exception):
    """A failure the command reports as one line on stderr (exit status 1)."""


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
