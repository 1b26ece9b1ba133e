"""The test suite; a package so that ``tests.models`` and ``tests.peers`` import from the root."""
