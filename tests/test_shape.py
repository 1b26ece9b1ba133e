"""The package's shape, as benchmarks/shape.py counts it, stays within issue 27's targets."""

from __future__ import annotations

from benchmarks.shape import is_private, shape


def test_no_module_imports_another_modules_underscore_names() -> None:
    assert shape()["underscore_import_list"] == []


def test_a_dunder_is_not_an_underscore_name() -> None:
    assert not is_private("__version__")
    assert is_private("_check")
    assert is_private("__mangled")
