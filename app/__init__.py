"""Phasewise composition root: CLI, settings, paths, wiring of engine and ui."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("phasewise")
except PackageNotFoundError:  # running from a source tree or a frozen bundle
    __version__ = "0.1.0"
