"""Every example runs to completion (and checks its own result)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiosync.runtime import child_env

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(script)], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
