"""The package's shape (issue 27), as ``python -m benchmarks.shape`` counts it, can only improve.

Zero capability lookups by name on planes and sinks are held by
``tests/unit/test_declared_interfaces.py``; the rest is here.
"""

from __future__ import annotations

from benchmarks.shape import MAX_LINES, is_private, shape

LONG_TODAY: dict[str, int] = {}
"""The modules still over the bound, each with its line count when listed: only to shrink."""

PUBLIC_API = {
    "aiosync.server.subscriber.Subscriber": "public: the server's subscriber, as users call it",
    "aiosync.engine.blocking.BackgroundReceiver": "public: the blocking receiver's options",
}
"""Constructors over 8 parameters that are public API: their keywords are what users write."""


def test_no_import_cycles() -> None:
    assert shape()["import_cycles"] == []


def test_no_module_grows_past_the_bound_or_its_listed_length() -> None:
    long: dict[str, int] = shape()["modules_over_400"]
    grown = {name: n for name, n in long.items() if n > LONG_TODAY.get(name, MAX_LINES)}
    assert grown == {}, f"modules over {MAX_LINES} lines (split them): {grown}"
    shrunk = sorted(set(LONG_TODAY) - set(long))
    assert shrunk == [], f"now at most {MAX_LINES} lines, drop them from LONG_TODAY: {shrunk}"


def test_no_module_imports_another_modules_underscore_names() -> None:
    assert shape()["underscore_import_list"] == []


def test_a_dunder_is_not_an_underscore_name() -> None:
    assert not is_private("__version__")
    assert is_private("_check")
    assert is_private("__mangled")


def test_no_internal_class_constructor_takes_over_8_parameters() -> None:
    wide = shape()["constructors_over_8"]
    assert {name: n for name, n in wide.items() if name not in PUBLIC_API} == {}
