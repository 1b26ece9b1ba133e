"""Tests through the public API in one process (in-process or ipc channels, shared memory)."""
