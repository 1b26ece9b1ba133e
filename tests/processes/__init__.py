"""Tests that spawn processes: peers, engines, the CLI, the examples."""
