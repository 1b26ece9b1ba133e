#!/usr/bin/env python3
"""Set up and run aiosync from a fresh checkout, with nothing but Python installed.

    python3 dev.py demo [demo options]   # install, then run `aiosync demo`
    python3 dev.py test [pytest options] # install with test extras, then lint, type-check, test

A virtual environment is made in .venv (override with AIOSYNC_VENV). It does not see the
system's site-packages, so a dependency missing from pyproject.toml fails here as it would
on a fresh machine. Where no torch is importable in it, AIOSYNC_TORCH (default
"torch==2.13.0") is installed.

On a machine whose system Python already has a (CUDA) build of torch, opt in to reusing it:

    python3 dev.py --system-site-packages test     # or AIOSYNC_SYSTEM_SITE_PACKAGES=1

An existing .venv made with the other setting is recreated.
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
PY = BIN / ("python.exe" if os.name == "nt" else "python")
SYSTEM_SITE_OPTION = "--system-site-packages"
SYSTEM_SITE_VARIABLE = "AIOSYNC_SYSTEM_SITE_PACKAGES"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"", "0", "false", "no", "off"}


def sh(*cmd: str | Path) -> None:
    """Run a command from the repository root; stop with its status if it fails."""
    print("+", " ".join(map(str, cmd)), flush=True)
    status = subprocess.call([str(c) for c in cmd], cwd=ROOT)
    if status:
        sys.exit(status)


def env_flag(name: str) -> bool:
    """An on/off environment variable; anything unrecognised stops with a message."""
    value = os.environ.get(name, "").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    sys.exit(f"dev.py: {name}={os.environ[name]!r}: use 1 or 0")


def venv_settings(path: Path) -> dict[str, str] | None:
    """The ``key = value`` lines of an environment's pyvenv.cfg, or None without one."""
    cfg = path / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    settings = {}
    for line in cfg.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            settings[key.strip().lower()] = value.strip()
    return settings


def ensure_venv(system_site_packages: bool) -> None:
    """Create the environment, or recreate it where it was made with the other setting."""
    settings = venv_settings(VENV)
    wanted = "true" if system_site_packages else "false"
    if settings is not None and PY.exists():
        had = settings.get("include-system-site-packages", "false").lower()
        if had == wanted:
            return
        print(
            f"dev.py: recreating {VENV}: it was made with include-system-site-packages = "
            f"{had}, and this run asks for {wanted}",
            flush=True,
        )
    elif settings is None and VENV.exists() and any(VENV.iterdir()):
        sys.exit(f"dev.py: {VENV} exists but is not a virtual environment; move it away")
    elif settings is not None:
        print(f"dev.py: recreating {VENV}: it has no Python", flush=True)
    print(
        f"+ python -m venv {'--system-site-packages ' if system_site_packages else ''}{VENV}",
        flush=True,
    )
    builder = venv.EnvBuilder(with_pip=True, system_site_packages=system_site_packages, clear=True)
    builder.create(VENV)


def install(extras: str, system_site_packages: bool) -> None:
    """Create the environment if needed and install the package (editable) into it."""
    ensure_venv(system_site_packages)
    probe = subprocess.run(
        [PY, "-c", "import torch; print(torch.__version__, torch.__file__)"],
        capture_output=True,
        text=True,
    )
    pip = [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if probe.returncode == 0:
        print(f"dev.py: using the torch already importable: {probe.stdout.strip()}", flush=True)
    else:
        sh(*pip, os.environ.get("AIOSYNC_TORCH", "torch==2.13.0"))
    sh(*pip, "-e", f".[{extras}]" if extras else ".")


def main(argv: list[str]) -> None:
    """Dispatch ``demo`` or ``test``, after the options that come before them."""
    system_site_packages = env_flag(SYSTEM_SITE_VARIABLE)
    while argv and argv[0] == SYSTEM_SITE_OPTION:
        system_site_packages = True
        argv = argv[1:]
    if not argv or argv[0] not in {"demo", "test"}:
        sys.exit(__doc__)
    command, rest = argv[0], argv[1:]
    if command == "demo":
        install("", system_site_packages)
        sh(BIN / "aiosync", "demo", *rest)
    else:
        install("test", system_site_packages)
        sh(PY, "-m", "ruff", "check", ".")
        sh(PY, "-m", "mypy")
        sh(PY, "-m", "pytest", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
