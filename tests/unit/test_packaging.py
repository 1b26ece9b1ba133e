"""What a fresh machine needs: every import is declared, and ``python -m aiosync`` works.

The import check reads every ``.py`` file under aiosync/, tests/ and examples/ with
:mod:`ast`, keeps the top-level modules that are neither standard library nor part of this
checkout, finds the distributions that provide them in this environment, and requires each
to be named in pyproject.toml's dependencies or in one of its extras.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("aiosync", "tests", "examples")
#: Always counts as declared: a CUDA machine may bring its own build of it.
ALWAYS_DECLARED = {"torch"}


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution named by a requirement string such as ``"uvloop>=0.19; ..."``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"cannot read requirement {requirement!r}"
    return normalize(match.group(1))


def declared_distributions(pyproject: Path) -> set[str]:
    """Every distribution named in ``[project] dependencies`` or any optional extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    return {requirement_name(r) for r in requirements}


def imported_modules(source: str) -> set[str]:
    """Top-level modules that ``source`` imports, at any depth, absolute imports only.

    ``importlib.import_module("name")`` with a literal name counts too.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return found


def local_modules(root: Path, files: Iterable[Path]) -> set[str]:
    """Names that resolve to this checkout: top-level packages and modules in ``root``, and
    the sibling modules of scripts in directories that are not packages (a script's own
    directory is on ``sys.path`` when it runs)."""
    names = {p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    names |= {p.stem for p in root.glob("*.py")}
    for file in files:
        if not (file.parent / "__init__.py").exists():
            names |= {p.stem for p in file.parent.glob("*.py")}
    return names


def third_party_imports(root: Path, files: Iterable[Path]) -> dict[str, set[str]]:
    """Module name -> the files (relative to ``root``) that import it, for every imported
    module that is neither in the standard library nor local."""
    files = list(files)
    local = local_modules(root, files)
    out: dict[str, set[str]] = {}
    for file in files:
        for module in imported_modules(file.read_text()):
            if module in sys.stdlib_module_names or module in local:
                continue
            out.setdefault(module, set()).add(str(file.relative_to(root)))
    return out


def undeclared(
    imports: Mapping[str, set[str]],
    declared: set[str],
    providers: Mapping[str, list[str]],
) -> dict[str, str]:
    """Module -> why it is not covered, for every import no declared distribution provides.

    ``providers`` maps a module to the distributions that install it (as
    :func:`importlib.metadata.packages_distributions` does); a module that nothing installed
    provides is taken to come from a distribution of its own name.
    """
    problems: dict[str, str] = {}
    for module, files in sorted(imports.items()):
        if module in ALWAYS_DECLARED:
            continue
        dists = providers.get(module) or [module]
        if not {normalize(d) for d in dists} & (declared | ALWAYS_DECLARED):
            problems[module] = (
                f"imported by {', '.join(sorted(files))}; provided by {', '.join(dists)}, "
                "which pyproject.toml does not declare (dependencies or an extra)"
            )
    return problems


def python_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


# --------------------------------------------------------------------------------------
# the checker itself
# --------------------------------------------------------------------------------------


def test_imported_modules_reads_every_import_form() -> None:
    source = """
import os, yaml.loader as loader
from requests import get
from . import sibling
from .pkg import thing
import importlib
importlib.import_module("transformers.models")

def lazy():
    from safetensors.torch import save_file
    try:
        import uvloop
    except ImportError:
        pass
"""
    assert imported_modules(source) == {
        "os",
        "yaml",
        "requests",
        "importlib",
        "transformers",
        "safetensors",
        "uvloop",
    }


def test_checker_flags_an_undeclared_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(
        "import json\nimport torch\nimport yaml\nfrom pkg import other\n"
    )
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run.py").write_text("import helper\nimport numpy\n")
    (tmp_path / "scripts" / "helper.py").write_text("")
    files = sorted(tmp_path.rglob("*.py"))

    imports = third_party_imports(tmp_path, files)
    assert imports == {
        "torch": {"pkg/mod.py"},
        "yaml": {"pkg/mod.py"},
        "numpy": {"scripts/run.py"},
    }
    providers = {"yaml": ["PyYAML"], "numpy": ["numpy"], "torch": ["torch"]}
    problems = undeclared(imports, {"numpy"}, providers)
    assert list(problems) == ["yaml"]
    assert "pkg/mod.py" in problems["yaml"]
    assert "PyYAML" in problems["yaml"]
    # declared under another spelling of the same name: covered
    assert undeclared(imports, {normalize("pyyaml"), "numpy"}, providers) == {}
    # not installed at all: judged by its own name
    assert list(undeclared({"nonesuch": {"x.py"}}, {"numpy"}, {})) == ["nonesuch"]


def test_declared_distributions_reads_dependencies_and_extras(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\n'
        'dependencies = ["uvloop>=0.19; sys_platform != \'win32\'", "Py_Yaml"]\n'
        '[project.optional-dependencies]\ntest = ["pytest-asyncio[testing]>=1"]\n'
    )
    assert declared_distributions(pyproject) == {"uvloop", "py-yaml", "pytest-asyncio"}


# --------------------------------------------------------------------------------------
# this checkout
# --------------------------------------------------------------------------------------


def test_every_import_is_declared() -> None:
    files = python_files()
    assert any(f.parts[-2:] == ("aiosync", "__init__.py") for f in files)
    imports = third_party_imports(ROOT, files)
    # sanity: the scan sees the dependencies it should, and nothing local
    assert {"torch", "zmq", "msgspec", "anyio", "pytest", "hypothesis"} <= set(imports)
    assert not {"aiosync", "tests"} & set(imports)
    problems = undeclared(
        imports,
        declared_distributions(ROOT / "pyproject.toml"),
        importlib.metadata.packages_distributions(),
    )
    assert not problems, "\n".join(f"{m}: {why}" for m, why in problems.items())


def test_dev_script_needs_only_the_standard_library() -> None:
    """`python3 dev.py` runs on a machine that has nothing but Python."""
    imports = imported_modules((ROOT / "dev.py").read_text())
    assert imports <= set(sys.stdlib_module_names), imports - set(sys.stdlib_module_names)


# --------------------------------------------------------------------------------------
# python -m aiosync
# --------------------------------------------------------------------------------------


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["no-such-command"]], ids=["help", "bad-command"])
def test_python_dash_m_aiosync_is_the_aiosync_command(argv: list[str]) -> None:
    module = run(sys.executable, "-m", "aiosync", *argv)
    expected = 0 if argv == ["--help"] else 2
    assert module.returncode == expected, module.stderr
    assert "usage: aiosync" in module.stdout + module.stderr
    if argv == ["--help"]:
        # nothing on stderr: no warning from an import (torch's "Failed to initialize NumPy")
        assert module.stderr == ""
    script = shutil.which("aiosync", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the aiosync script is not installed next to this Python")
    installed = run(script, *argv)
    assert (installed.returncode, installed.stdout, installed.stderr) == (
        module.returncode,
        module.stdout,
        module.stderr,
    )


def test_the_package_version_is_the_one_pyproject_declares() -> None:
    import aiosync

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert aiosync.__version__ == declared
    assert importlib.metadata.version("aiosync") == declared
