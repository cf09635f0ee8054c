"""Keep a test run out of the user's home: caches, data, config and keyring in one temporary
folder for the whole run (tests/conftest.py calls `isolate` before anything computes a path).

Without it, tests read and write ~/.cache/phasewise (kernel probes, converted models,
calibration), so a run could take a kernel an earlier run chose, and the chat database,
QSettings and the OS keyring were the user's. Child processes inherit the environment, so the
children that tests spawn are kept out too. HOME itself stays: compiler caches under it
(Triton, fontconfig's system cache) change no behaviour, and the llama.cpp wheel cache the
Makefile keeps in ~/.cache/phasewise/wheels is read before pytest starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ROOT_ENV = "PHASEWISE_TEST_ROOT"  # the run's temporary home for everything below
# What each variable points at under the root: the app's own overrides first
# (engine.runtimes.torch.loader's cache_root, ui.store's data_dir), then the XDG homes that
# platformdirs and QStandardPaths (QSettings' default file, Qt's caches) resolve, and keyring's
# config.
DIRS = {
    "PHASEWISE_CACHE_DIR": "cache",
    "PHASEWISE_DATA_DIR": "data",
    "XDG_CACHE_HOME": "xdg-cache",
    "XDG_CONFIG_HOME": "xdg-config",
    "XDG_DATA_HOME": "xdg-data",
    "XDG_STATE_HOME": "xdg-state",
}
# A keyring that refuses every call: the user's secrets are never read or written (the app
# then says no keyring is available, or takes the key from PHASEWISE_API_KEY).
KEYRING_BACKEND = "keyring.backends.fail.Keyring"


def isolate() -> Path:
    """Point every per-user directory at a fresh temporary folder (in os.environ, so child
    processes follow) and return that folder. Call once, before importing the app."""
    root = Path(tempfile.mkdtemp(prefix="phasewise-tests-")).resolve()
    os.environ[ROOT_ENV] = str(root)
    for name, sub in DIRS.items():
        (root / sub).mkdir()
        os.environ[name] = str(root / sub)
    os.environ["PYTHON_KEYRING_BACKEND"] = KEYRING_BACKEND
    return root


def remove(root: Path) -> None:
    """Delete the run's folder (converted models, probes, databases) at the end of the run."""
    shutil.rmtree(root, ignore_errors=True)
