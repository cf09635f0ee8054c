"""Tests never touch the user's home: every per-user directory the app resolves (its caches,
chats, settings, keyring) is inside the run's temporary folder (tests/support/isolation.py), in this
process and in the child processes tests spawn."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.isolation import KEYRING_BACKEND, ROOT_ENV

ROOT = Path(__file__).resolve().parents[2]
CHILD = ("import json; from tests.project.test_isolation import resolve; "
         "print(json.dumps(resolve()))")


def resolve() -> dict[str, str]:
    """Every directory the app (and what it builds on) would read or write per user, by the
    app's own functions; run here and in a child process."""
    import platformdirs

    from engine import model_files
    from engine.runtimes.torch import kernels
    from ui.store import data_dir

    return {
        "cache_root": str(model_files.cache_root()),
        "converted models": str(model_files.models_dir()),
        "kernel probes": str(kernels.probe_cache_path()),
        "kernel smoke runs": str(kernels.smoke_cache_path()),
        "chats": str(data_dir()),
        "platformdirs cache": platformdirs.user_cache_dir("Phasewise", "Phasewise"),
        "platformdirs data": platformdirs.user_data_dir("Phasewise", "Phasewise"),
        "platformdirs config": platformdirs.user_config_dir("Phasewise", "Phasewise"),
        "platformdirs state": platformdirs.user_state_dir("Phasewise", "Phasewise"),
    }


def user_dirs() -> list[Path]:
    """The real user's own per-user folders (from the password database, not $HOME)."""
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    return [home / ".cache", home / ".config", home / ".local"]


def assert_isolated(paths: dict[str, str]) -> None:
    root = Path(os.environ[ROOT_ENV])
    for what, text in paths.items():
        path = Path(text).resolve()
        assert path.is_relative_to(root), f"{what}: {path} is outside the run's folder {root}"
        assert not any(path.is_relative_to(d) for d in user_dirs()), f"{what}: {path}"


def test_the_apps_directories_are_the_runs_own() -> None:
    paths = resolve()
    assert_isolated(paths)
    # Nothing may quietly resolve to the same folder as another (a probe in the chats folder).
    assert Path(paths["cache_root"]) != Path(paths["chats"])


def test_qt_settings_and_standard_paths_are_the_runs_own(qapp) -> None:
    from PySide6.QtCore import QSettings, QStandardPaths

    kinds = {"config": QStandardPaths.StandardLocation.AppConfigLocation,
             "data": QStandardPaths.StandardLocation.AppDataLocation,
             "cache": QStandardPaths.StandardLocation.CacheLocation,
             "generic config": QStandardPaths.StandardLocation.GenericConfigLocation,
             "generic cache": QStandardPaths.StandardLocation.GenericCacheLocation}
    paths = {name: QStandardPaths.writableLocation(kind) for name, kind in kinds.items()}
    # QSettings() as app.gui makes it, with the app's names: the user's settings file
    paths["QSettings"] = QSettings("Phasewise", "Phasewise").fileName()
    assert_isolated(paths)


def test_the_users_keyring_is_never_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    import keyring

    from engine.remote import API_KEY_ENV, resolve_api_key, store_api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    backend = type(keyring.get_keyring())
    assert f"{backend.__module__}.{backend.__name__}" == KEYRING_BACKEND
    assert resolve_api_key("http://127.0.0.1:9/v1") is None
    with pytest.raises(keyring.errors.KeyringError):
        store_api_key("http://127.0.0.1:9/v1", "secret")


def test_child_processes_are_isolated_too() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout)
    assert_isolated(child)
    assert child == resolve()  # the same folders: one conversion, one probe, per run
