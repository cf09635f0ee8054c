"""Entry point of the frozen bundle: the same `phasewise` command as the console script."""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
