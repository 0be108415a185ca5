"""The reductions never change what the search can reach: with sleep sets on and off, every
scenario ends in the same set of end states within the same bound, and the reductions that
make a load or a call free of choice points are switched off by what would make them unsound.
Counts, not timings: how much faster it runs is bench/race_bench.py's job."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from isolab.race.checkers import FIXES, MUTANT_OF
from isolab.race.explorer import Outcome, Scenario, SwitchMode, bounded_search, load
from isolab.race.fixtures import SCENARIOS as FIXTURES
from isolab.race.scenarios import passcode
from isolab.race.workloads import SCENARIOS as WORKLOADS

SCENARIOS = {**{f"fixtures:{n}": f for n, f in FIXTURES.items()},
             **{f"passcode:{v}": (lambda v=v: passcode(v)) for v in ("buggy", *FIXES, *MUTANT_OF.values())},
             "workloads:counter_3x3": WORKLOADS["counter_3x3"]}


def _end_states(scenario: Scenario, mode: SwitchMode, reduction: bool) -> tuple[set[tuple[str, str, str]], int]:
    states: set[tuple[str, str, str]] = set()

    def keep(execution) -> None:
        if execution.outcome is not Outcome.REDUNDANT:
            states.add((execution.outcome.value, execution.message or "", execution.final))

    result = bounded_search(scenario, bound=2, mode=mode, count_all=True, on_execution=keep, reduction=reduction)
    assert result.exhausted
    return states, result.executions


@pytest.mark.parametrize("mode", [SwitchMode.GIL, SwitchMode.OPCODE])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sleep_sets_reach_exactly_the_end_states_of_the_full_search(name: str, mode: SwitchMode) -> None:
    reduced, n_reduced = _end_states(SCENARIOS[name](), mode, reduction=True)
    full, n_full = _end_states(SCENARIOS[name](), mode, reduction=False)
    assert reduced == full
    assert n_reduced <= n_full


def _bump_a(s):
    for _ in range(2):
        s.a += 1


def _bump_b(s):
    for _ in range(2):
        s.b += 1


def test_sleep_sets_skip_reorderings_of_independent_steps() -> None:
    from types import SimpleNamespace

    disjoint = Scenario("disjoint", lambda: SimpleNamespace(a=0, b=0), (_bump_a, _bump_b, _bump_a),
                        lambda s, r: None if (s.a, s.b) == (4, 2) else f"a={s.a} b={s.b}")
    reduced_states, reduced = _end_states(disjoint, SwitchMode.OPCODE, reduction=True)
    full_states, full = _end_states(disjoint, SwitchMode.OPCODE, reduction=False)
    assert reduced_states == full_states and len(full_states) > 1  # lost updates of `a`, none of `b`
    assert reduced * 3 <= full * 2  # 1,186 of 2,022 when this was written


INDIRECT = """
from types import SimpleNamespace
from isolab.race.explorer import Scenario

def writer(s):
    {write}

def reader(s):
    a = s.x
    b = s.x
    return a == b

def scenario():
    return Scenario("indirect", lambda: SimpleNamespace(x=0), (writer, reader),
                    lambda s, r: None if r[1] else "torn read: s.x changed between two reads")
"""


@pytest.mark.parametrize("write", ["setattr(s, 'x', 1)", "vars(s)['x'] = 1", "s.__dict__['x'] = 1"])
def test_an_indirect_write_keeps_loads_of_every_name_visible(tmp_path: Path, write: str) -> None:
    path = tmp_path / "indirect.py"
    path.write_text(textwrap.dedent(INDIRECT.format(write=write)))
    scenario = load(f"{path}:scenario")
    assert scenario.readonly_names == frozenset()
    assert bounded_search(scenario, bound=1, mode=SwitchMode.OPCODE).failure is not None


def test_without_the_indirect_write_check_the_torn_read_is_missed(tmp_path: Path, monkeypatch) -> None:
    from isolab.race.explorer import scope

    monkeypatch.setattr(scope, "INDIRECT_WRITERS", frozenset())  # the protection off
    path = tmp_path / "indirect_off.py"
    path.write_text(textwrap.dedent(INDIRECT.format(write="setattr(s, 'x', 1)")))
    assert bounded_search(load(f"{path}:scenario"), bound=1, mode=SwitchMode.OPCODE).failure is None


def test_a_name_stored_by_a_body_is_never_treated_as_read_only() -> None:
    scenario = passcode("buggy")
    assert ("attr", "input_buffer") not in scenario.readonly_names  # stored by check()
    assert ("attr", "correct") in scenario.readonly_names  # stored only in __init__


def test_the_race_path_imports_no_torch() -> None:
    """`isolab race` never loads torch: isolab/__init__ loads the engine only on first use, and the
    whole command path (CLI, explorer, checkers) is torch-free."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(root)!r})
        from isolab.cli import main
        rc = main(["race", "explore", "passcode:buggy", "--quiet", "--switch", "gil"])
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers"))
        print(rc, heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "1 []"


def test_every_explorer_module_imports_alone_without_a_cycle() -> None:
    """Each module of the explorer and the race command, imported first in a fresh interpreter
    (with a bare parent package, so the engine is not loaded), must import on its own."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    modules = sorted(f"isolab.race.explorer.{p.stem}" for p in (root / "isolab/race/explorer").glob("*.py")
                     if p.stem != "__init__") + ["isolab.race.explorer", "isolab.commands.race"]
    code = textwrap.dedent(f"""
        import importlib, sys, types
        for name in {modules!r}:
            for loaded in [m for m in sys.modules if m == "isolab" or m.startswith("isolab.")]:
                del sys.modules[loaded]
            pkg = types.ModuleType("isolab"); pkg.__path__ = [{str(root / "isolab")!r}]
            sys.modules["isolab"] = pkg
            importlib.import_module(name)
        print("ok", len({modules!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(len(modules))]
