"""Phasewise UI: PySide6 widgets. May import engine's public types; never app."""
