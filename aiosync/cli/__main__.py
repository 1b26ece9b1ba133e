"""``python -m aiosync.cli``: the same as ``python -m aiosync`` and the ``aiosync`` script."""

import sys

from aiosync.cli import main

if __name__ == "__main__":
    sys.exit(main())
