"""``python -m aiosync ...``: the same command line as the ``aiosync`` script."""

import sys

from aiosync.cli import main

if __name__ == "__main__":
    sys.exit(main())
