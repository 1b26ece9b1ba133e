"""Temporary alias of :mod:`aiosync.core.errors` while the package is reshaped."""

from aiosync.core.errors import *  # noqa: F403
from aiosync.core.errors import AiosyncError as AiosyncError
