"""Benchmarks for ``aiosync bench``: baselines, physical floor, and synthetic models."""
