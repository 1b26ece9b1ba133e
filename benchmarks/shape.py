"""The package's shape, as the consolidation issue counts it: ``python -m benchmarks.shape``.

Prints one JSON object: lines in ``aiosync/``, modules over 400 lines, internal classes whose
constructor takes more than 8 parameters, capability lookups by name on planes and sinks
(``getattr(plane, "...")``, ``getattr(sink, "...")`` and ``type: ignore[attr-defined]``),
imports of another module's underscore names, and import cycles among the package's modules.
Read from the source with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aiosync"
MAX_LINES = 400
MAX_PARAMETERS = 8
LOOKUP = re.compile(r"getattr\(\s*(?:self\.)?_?(?:plane|sink)\b")


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the package, by dotted name."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def imported(module: str, tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import of a package module."""
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base.startswith("aiosync"):
                yield base, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("aiosync"):
                    yield alias.name, []


def is_private(name: str) -> bool:
    """An underscore name no other module should import; a dunder (``__version__``) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def shape() -> dict[str, Any]:
    """Every figure, as one mapping."""
    total = 0
    long: dict[str, int] = {}
    wide: dict[str, int] = {}
    lookups = 0
    private: list[str] = []
    graph: dict[str, set[str]] = {}
    names = {name for name, _ in modules()}
    for name, path in modules():
        text = path.read_text()
        lines = text.count("\n")
        total += lines
        if lines > MAX_LINES:
            long[name] = lines
        lookups += len(LOOKUP.findall(text)) + text.count("type: ignore[attr-defined]")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        args = item.args
                        count = len(args.args) - 1 + len(args.kwonlyargs)
                        if count > MAX_PARAMETERS:
                            wide[f"{name}.{node.name}"] = count
        targets = graph.setdefault(name, set())
        for target, taken in imported(name, tree):
            while target not in names and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                targets.add(target)
            private += [f"{name} <- {target}.{n}" for n in taken if is_private(n)]
    return {
        "lines": total,
        "modules": len(names),
        "modules_over_400": long,
        "constructors_over_8": wide,
        "capability_lookups": lookups,
        "underscore_imports": len(private),
        "underscore_import_list": private,
        "import_cycles": cycles(graph),
    }


if __name__ == "__main__":
    print(json.dumps(shape(), indent=1))
