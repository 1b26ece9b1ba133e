"""Tests that need CUDA (marked ``gpu`` or ``multigpu``; they skip without a device)."""
