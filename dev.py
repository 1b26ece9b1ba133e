#!/usr/bin/env python3
"""Set up and run aiosync from a fresh checkout, with nothing but Python installed.

    python3 dev.py demo [demo options]   # install, then run `aiosync demo`
    python3 dev.py test [pytest options] # install with test extras, then lint, type-check, test

A virtual environment is made in .venv (override with AIOSYNC_VENV). It sees the system's
packages, so a CUDA build of torch already installed there is used as is; without any torch,
AIOSYNC_TORCH (default "torch==2.13.0") is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("AIOSYNC_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"


def sh(*cmd: str | Path) -> None:
    """Run a command from the repository root; stop with its status if it fails."""
    print("+", " ".join(map(str, cmd)), flush=True)
    status = subprocess.call([str(c) for c in cmd], cwd=ROOT)
    if status:
        sys.exit(status)


def install(extras: str) -> None:
    """Create the environment if needed and install the package (editable) into it."""
    if not PY.exists():
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(VENV)
    has_torch = subprocess.call([PY, "-c", "import torch"], stderr=subprocess.DEVNULL) == 0
    pip = [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if not has_torch:
        sh(*pip, os.environ.get("AIOSYNC_TORCH", "torch==2.13.0"))
    sh(*pip, "-e", f".[{extras}]" if extras else ".")


def main(argv: list[str]) -> None:
    """Dispatch ``demo`` or ``test``."""
    if not argv or argv[0] not in {"demo", "test"}:
        sys.exit(__doc__)
    command, rest = argv[0], argv[1:]
    if command == "demo":
        install("")
        sh(BIN / "aiosync", "demo", *rest)
    else:
        install("test")
        sh(PY, "-m", "ruff", "check", ".")
        sh(PY, "-m", "mypy")
        sh(PY, "-m", "pytest", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
