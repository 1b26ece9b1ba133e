#!/usr/bin/env python3
"""Set up and run aiosync from a fresh checkout, with nothing but Python installed.

    python3 dev.py demo [demo options]   # install, then run `aiosync demo`
    python3 dev.py test [pytest options] # install with test extras, then lint, type-check, test

A virtual environment is made in .venv (override with AIOSYNC_VENV). It does not see the
system's site-packages, so a dependency missing from pyproject.toml fails here as it would
on a fresh machine. Where no torch is importable in it, torch 2.13.0 is installed: on Linux
without an NVIDIA GPU (no /dev/nvidia0, no nvidia-smi) its CPU build (about 200 MB) from
PyTorch's CPU index when that answers, else PyPI's build (on Linux the CUDA one, several GB).
AIOSYNC_TORCH overrides that choice: "cpu" for the CPU build, or any pip requirement
("torch==2.11.0"), installed as given from pip's own indexes.

On a machine whose system Python already has a (CUDA) build of torch, opt in to reusing it:

    python3 dev.py --system-site-packages test     # or AIOSYNC_SYSTEM_SITE_PACKAGES=1

An existing .venv made with the other setting is recreated.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("AIOSYNC_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
SYSTEM_SITE_OPTION = "--system-site-packages"
SYSTEM_SITE_VARIABLE = "AIOSYNC_SYSTEM_SITE_PACKAGES"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"", "0", "false", "no", "off"}
TORCH_VARIABLE = "AIOSYNC_TORCH"
TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_SECONDS = 5.0


def call(*cmd: str | Path) -> int:
    """Run a command from the repository root; return its exit status."""
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=ROOT)


def sh(*cmd: str | Path) -> None:
    """Run a command from the repository root; stop with its status if it fails."""
    status = call(*cmd)
    if status:
        sys.exit(status)


# --- where torch comes from ------------------------------------------------------------------


@dataclass(frozen=True)
class TorchSource:
    """What to install for torch: a requirement, an extra index, and what to say about it."""

    requirement: str
    why: str
    index: str | None = None  # an extra index, on top of pip's own
    fallback: TorchSource | None = None  # installed instead if this one fails

    def pip_args(self) -> list[str]:
        """The arguments of ``pip install`` for this source."""
        extra = ["--extra-index-url", self.index] if self.index else []
        return [*extra, self.requirement]


def torch_source(
    override: str | None, *, platform: str, gpu: bool, cpu_index_answers: Callable[[], bool]
) -> TorchSource:
    """Choose where torch comes from; ``cpu_index_answers`` is asked only when it decides.

    ``override`` (AIOSYNC_TORCH) wins: ``cpu`` is the CPU build, anything else a pip
    requirement as given. Otherwise a Linux machine without an NVIDIA GPU gets the CPU build
    when PyTorch's CPU index answers, with PyPI's build to fall back on; everywhere else
    PyPI's build (on macOS and Windows it is a CPU build already).
    """
    plain = f"torch=={TORCH_VERSION}"
    cpu = f"{plain}+cpu"
    if override and override.strip().lower() != "cpu":
        return TorchSource(override.strip(), f"{TORCH_VARIABLE}={override.strip()}")
    if override:
        return TorchSource(cpu, f"{TORCH_VARIABLE}=cpu: the CPU build", CPU_INDEX)
    if platform != "linux":
        return TorchSource(plain, f"PyPI's build for {platform}")
    if gpu:
        return TorchSource(
            plain, f"an NVIDIA GPU is present: PyPI's CUDA build ({TORCH_VARIABLE}=cpu: CPU build)"
        )
    fallback = TorchSource(
        plain, "the CPU build failed to install: PyPI's build instead (the CUDA one, several GB)"
    )
    if not cpu_index_answers():
        return TorchSource(
            plain,
            f"no NVIDIA GPU, but {CPU_INDEX} does not answer: PyPI's build instead (the CUDA "
            "one, several GB, unless pip's own indexes have another)",
        )
    return TorchSource(cpu, "no NVIDIA GPU: the CPU build (about 200 MB)", CPU_INDEX, fallback)


def has_nvidia_gpu() -> bool:
    """True where the NVIDIA driver shows a device or its ``nvidia-smi`` is installed."""
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def answers(url: str, timeout: float = PROBE_SECONDS) -> bool:
    """True if ``url`` answers a HEAD request within ``timeout`` seconds (pip's CA file used)."""
    import ssl

    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    try:
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return int(response.status) < 400
    except (OSError, ValueError):  # no route, no name, TLS, timeout, HTTP error
        return False


def install_torch(pip: list[str | Path]) -> None:
    """Install torch from the chosen source, and from its fallback if that fails."""
    source: TorchSource | None = torch_source(
        os.environ.get(TORCH_VARIABLE),
        platform=sys.platform,
        gpu=has_nvidia_gpu(),
        cpu_index_answers=lambda: answers(f"{CPU_INDEX}/torch/"),
    )
    while source is not None:
        print(f"dev.py: torch: {source.why}", flush=True)
        status = call(*pip, *source.pip_args())
        if not status:
            return
        if source.fallback is None:
            sys.exit(status)
        source = source.fallback


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
    pip: list[str | Path] = [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if probe.returncode == 0:
        print(f"dev.py: using the torch already importable: {probe.stdout.strip()}", flush=True)
    else:
        install_torch(pip)
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
