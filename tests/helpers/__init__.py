"""Shared helpers and the scripts tests run as processes (``python -m tests.helpers.NAME``)."""
