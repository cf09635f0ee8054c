"""Every Backend keeps the same promises (tests/support/backend_checks.py), whatever runs the
model."""

from __future__ import annotations

from pathlib import Path

from engine.protocol import Backend
from tests.support import backend_checks as checks
from tests.support.backend_checks import BAD_LOADS, TINY


def test_is_a_backend(backend: Backend, backend_kind: str) -> None:
    assert Backend in type(backend).__mro__  # it declares the protocol: mypy checks it
    assert backend.is_remote == (backend_kind == "remote")
    assert backend.model_info is not None


def test_event_order(backend: Backend) -> None:
    checks.check_event_order(backend)


def test_metric_identities(backend: Backend) -> None:
    checks.check_metric_identities(backend)


def test_cancel(backend: Backend) -> None:
    checks.check_cancel(backend)


def test_bad_input_fails_in_one_line(backend: Backend) -> None:
    checks.check_bad_input(backend)


def test_alternatives(backend: Backend) -> None:
    checks.check_alternatives(backend)


def test_failed_load_keeps_the_model(backend: Backend, backend_kind: str) -> None:
    spec, options = BAD_LOADS[backend_kind]
    checks.check_failed_load_keeps_model(backend, spec, **options)


def test_capabilities_match_behaviour(backend: Backend, backend_kind: str,
                                      tiny_model_dir: Path) -> None:
    if backend_kind == "remote":  # nothing to load: it must refuse a draft
        checks.check_capabilities(backend)
    else:  # the model is its own draft: every proposal is accepted, the output is the same
        checks.check_capabilities(backend, str(tiny_model_dir), **TINY)
