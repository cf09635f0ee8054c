"""The project's layout rules, checked (docs/architecture.md): no import cycle among app, ui and
engine, and tests that share code through tests/support/, never by importing one another.
`make lint` runs this file too."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGES = ("app", "ui", "engine")


# ----- import cycles ---------------------------------------------------------------------------
def project_graph() -> grimp.ImportGraph:
    """The module-level import graph of the project's packages. Imports inside functions and
    under `if TYPE_CHECKING:` count (exclude_type_checking_imports=False): a type named across
    a cycle, or an import moved into a function to dodge one, is still a dependency both ways."""
    return grimp.build_graph(*PACKAGES, include_external_packages=False,
                             exclude_type_checking_imports=False, cache_dir=None)


def _reachable(graph: grimp.ImportGraph, start: str) -> set[str]:
    seen: set[str] = set()
    todo = deque(graph.find_modules_directly_imported_by(start))
    while todo:
        module = todo.popleft()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.find_modules_directly_imported_by(module))
    return seen


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each group of modules that import one another, directly or not (a strongly connected
    component of more than one module), sorted."""
    reach = {module: _reachable(graph, module) for module in graph.modules}
    cycles, placed = [], set()
    for module in sorted(reach):
        if module in placed:
            continue
        group = {module} | {other for other in reach[module] if module in reach[other]}
        placed |= group
        if len(group) > 1:
            cycles.append(sorted(group))
    return cycles


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """A cycle's modules and the import lines that join them."""
    members = set(cycle)
    lines = [f"cycle of {len(cycle)} modules: {', '.join(cycle)}"]
    for importer in cycle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer}:{detail['line_number']}: {detail['line_contents']}")
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = project_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (break each at its root):\n" + "\n".join(
        describe(graph, cycle) for cycle in cycles)


def test_the_cycle_check_finds_every_cycle_and_only_cycles() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [("a.x", "a.y"), ("a.y", "a.z"), ("a.z", "a.x"),  # x -> y -> z -> x
                               ("a.w", "a.x"),  # into the cycle, not part of it
                               ("a.p", "a.q"), ("a.q", "a.p"),  # a second cycle
                               ("a.r", "a.s")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["a.p", "a.q"], ["a.x", "a.y", "a.z"]]


# ----- tests share code through tests/support, never by importing each other --------------
def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) for every import in source, wherever it is (in a function too);
    `from p import n` yields both p and p.n (n may be a module); relative imports resolved
    against `module`'s package."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def is_test_module(name: str) -> bool:
    """A module pytest collects or configures: tests' test_*.py and conftest.py."""
    last = name.rsplit(".", 1)[-1]
    return name.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def imports_of_test_modules(source: str, module: str) -> list[str]:
    """The test modules that `module` (with this source) imports, other than itself."""
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(source, module)
            if is_test_module(name) and name != module]


def test_no_module_under_tests_imports_a_test_module() -> None:
    """A helper two test modules share lives in tests/support/: importing a test module runs
    its module-level code (marks, fixtures) and ties one test file's edits to another's."""
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        offences += imports_of_test_modules(path.read_text(encoding="utf-8"), _module_name(path))
    assert not offences, "move what is shared into tests/support/:\n" + "\n".join(offences)


def test_the_import_check_sees_every_form_of_import() -> None:
    source = """
import tests.test_a
import tests.test_b as b
from tests.test_c import helper
from tests import test_d
from . import test_e
from .test_f import helper
from tests.support.child import run_in_child
from tests.contract.conftest import TINY
from tests.test_self import me

def body():
    from tests.test_g import inner
"""
    found = imports_of_test_modules(source, "tests.test_self")
    named = sorted(line.rsplit(" ", 1)[1] for line in found)
    assert named == ["tests.contract.conftest", "tests.test_a", "tests.test_b", "tests.test_c",
                     "tests.test_d", "tests.test_e", "tests.test_f", "tests.test_g"]
    assert imports_of_test_modules("from tests.support.window_helpers import WAIT_MS\n",
                           "tests.test_x") == []


def test_helper_modules_live_in_tests_support() -> None:
    """Outside tests/support/, tests/ holds test modules, conftest.py and packages' __init__."""
    misplaced = [str(path.relative_to(ROOT)) for path in sorted(TESTS.rglob("*.py"))
                 if TESTS / "support" not in path.parents
                 and not path.name.startswith("test_")
                 and path.name not in ("conftest.py", "__init__.py")]
    assert not misplaced, f"helper modules outside tests/support/: {misplaced}"


LAYERS = {"core", "runtimes", "engine", "tools", "ui", "app", "project", "contract", "support",
          "data"}


def test_tests_are_grouped_by_layer() -> None:
    """Each test module sits in the folder of the layer it tests (docs/architecture.md), none
    loose in tests/ and no folder outside the known layers."""
    loose = sorted(path.name for path in TESTS.glob("test_*.py"))
    folders = {path.name for path in TESTS.iterdir()
               if path.is_dir() and not path.name.startswith((".", "__"))}
    assert not loose, f"test modules outside a layer's folder: {loose}"
    assert folders <= LAYERS, f"folders that are no layer: {sorted(folders - LAYERS)}"


# ----- the light front ---------------------------------------------------------------------------
FRONT = ("engine", "engine.protocol", "engine.events", "engine.params", "engine.metrics",
         "engine.errors", "engine.remote", "engine.forecast", "engine.model_files",
         "engine.runtime_choice", "engine.documents", "ui.session", "ui.store", "ui.hud.model")
HEAVY = ("torch", "transformers", "llama_cpp", "PySide6")


def test_the_front_loads_no_runtime_and_no_qt() -> None:
    """What the window and the commands import first (the protocol, events, params, metrics,
    the chat session and the HUD's view-model) loads neither torch, transformers, llama.cpp nor
    Qt: a command answers --help at once, and the session's logic is testable on its own."""
    probe = (f"import importlib, sys\nfor name in {FRONT!r}: importlib.import_module(name)\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


# ----- the mutation run's test selection -----------------------------------------------------
def test_the_mutation_selection_names_tests_that_exist() -> None:
    """`make mutation` runs the tests pyproject's [tool.mutmut] names: a renamed test must be
    renamed there too, or the run errors (or judges every mutant against too few tests)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    for entry in config["pytest_add_cli_args_test_selection"]:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        if name:
            functions = {node.name for node in ast.walk(ast.parse((ROOT / path).read_text()))
                         if isinstance(node, ast.FunctionDef)}
            assert name in functions, entry
    for module in config["only_mutate"]:
        assert (ROOT / module).is_file(), module
