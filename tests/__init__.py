"""The test suite; a package so that ``tests.helpers.models`` and the rest import from the root."""
