"""Temporary alias of :mod:`aiosync.core.layout` while the package is reshaped."""

from aiosync.core.layout import *  # noqa: F403
from aiosync.core.layout import _DTYPES as _DTYPES
