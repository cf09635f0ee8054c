"""The CLI's one error: a line for stderr (app/cli.py prints it and exits 1). Its own module so
that app/cli.py and app/remote_cli.py, which cli.py calls into, both raise it without importing
each other."""

from __future__ import annotations


class CliError(Exception):
    """A one-line message for stderr."""
