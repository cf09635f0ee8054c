"""Entry point of the frozen bundle: the same `phasewise` command as the console script."""

from app.cli import entry

if __name__ == "__main__":
    entry()
