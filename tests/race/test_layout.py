"""The race lab's layout: every module imports on its own, no import cycle anywhere in isolab/race
(counting imports inside functions and under `if TYPE_CHECKING`: a cycle there is still two
modules that each need the other), and each explorer module is small and says what it owns."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from isolab.testing.imports import find_cycle, imports_of, module_name

ROOT = Path(__file__).resolve().parents[2]
RACE = ROOT / "isolab" / "race"
EXPLORER = RACE / "explorer"


def _module_name(path: Path) -> str:
    return module_name(path, ROOT)


MODULES = {_module_name(p): p for p in sorted(RACE.rglob("*.py"))}


def _imports(path: Path, name: str) -> set[str]:
    """The isolab.race modules `path` imports, wherever the import statement stands."""
    return imports_of(path, name, MODULES, everywhere=True)


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: _imports(path, name) & set(modules) for name, path in modules.items()}


_cycle = find_cycle


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _cycle({"p": {"p.x"}, "p.x": set()}) is None


def test_the_import_parser_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "from isolab.race.explorer import gil, Scenario\nimport isolab.race.checkers\n"
              "if TYPE_CHECKING:\n    from isolab.race.explorer.runtime import Runtime\n"
              "def f():\n    from . import tracer\n    from .types import Outcome\n")
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert _imports(path, "isolab.race.explorer.mod") == {
        "isolab.race.explorer.gil", "isolab.race.explorer", "isolab.race.checkers",
        "isolab.race.explorer.runtime", "isolab.race.explorer.tracer", "isolab.race.explorer.types"}


def test_no_import_cycle_among_the_explorer_modules() -> None:
    explorer = {name: path for name, path in MODULES.items() if name.startswith("isolab.race.explorer")}
    graph = _graph(explorer)
    assert len(graph) >= 15 and graph["isolab.race.explorer.runtime"]  # the parser saw the explorer
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_anywhere_in_the_race_lab() -> None:
    cycle = _cycle(_graph(MODULES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_types_imports_nothing_from_the_explorer() -> None:
    assert _graph(MODULES)["isolab.race.explorer.types"] == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_race_module_imports_alone_in_a_fresh_interpreter(module: str) -> None:
    run = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"`python -c 'import {module}'` failed:\n{run.stderr[-2000:]}"


@pytest.mark.parametrize("path", sorted(EXPLORER.glob("*.py")), ids=lambda p: p.name)
def test_each_explorer_module_is_small_and_says_what_it_owns(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"{path.name} has {len(lines)} lines: split it by what it owns"
    docstring = ast.get_docstring(ast.parse("\n".join(lines))) or ""
    assert docstring.startswith("Owns "), f"{path.name}: the first docstring line should say what it owns"
