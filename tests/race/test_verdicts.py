"""Every way a target can fall outside the model ends as a correct verdict or as an inconclusive
with one sentence, through the real CLI, with distinct exit codes:
0 holds, 1 bug found, 2 usage or target error (one line on stderr), 3 inconclusive (reason named).
Each target is written to a fresh folder, as an outside user would."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from isolab.cli import main
from isolab.race.explorer import ExitCode

HEADER = """
import threading
from types import SimpleNamespace
from isolab.race.explorer import Scenario
"""


def _target(tmp_path: Path, body: str, name: str = "target.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(HEADER) + textwrap.dedent(body))
    return str(path)


def _explore(target: str, *extra: str) -> int:
    return main(["race", "explore", f"{target}:scenario", "--quiet", *extra])


CLASS_LOCK = """
class Counter:
    _lock = threading.Lock()  # made at import, before exploring: swapped for a model per execution

    def __init__(self):
        self.value = 0

    def bump(self):
        with Counter._lock:
            v = self.value
            self.value = v + 1

def scenario():
    return Scenario("class-lock", Counter, (Counter.bump, Counter.bump),
                    lambda c, r: None if c.value == 2 else f"lost update: {c.value}")
"""

IMPORTED_LOCK = """
from threading import Lock

class Box:
    def __init__(self):
        self.lock, self.value = Lock(), 0

def bump(b):
    with b.lock:
        v = b.value
        b.value = v + 1

def scenario():
    return Scenario("from-import", Box, (bump, bump), lambda b, r: None if b.value == 2 else "lost")
"""


@pytest.mark.parametrize("source", [CLASS_LOCK, IMPORTED_LOCK])
def test_locks_made_before_exploring_are_modelled_and_the_fix_holds(tmp_path: Path, source: str, capsys) -> None:
    assert _explore(_target(tmp_path, source), "--bound", "2") == ExitCode.HOLDS
    assert "HOLDS: every schedule within the bound passed" in capsys.readouterr().out


def test_class_level_lock_deadlock_is_found_not_a_hang(tmp_path: Path, capsys) -> None:
    source = CLASS_LOCK.replace("with Counter._lock:\n            v = self.value",
                                "with Counter._lock:\n            Counter._lock.acquire()\n            v = self.value")
    assert _explore(_target(tmp_path, source)) == ExitCode.BUG
    assert "deadlock: T0 waits for Counter._lock held by T0" in capsys.readouterr().out


def test_without_swapping_a_class_level_lock_blocks_outside_the_model(tmp_path: Path, monkeypatch, capsys) -> None:
    from isolab.race.explorer import patch

    monkeypatch.setattr(patch, "_swaps", lambda rt, modules, fakes: [])  # the protection off
    source = CLASS_LOCK.replace("v = self.value", "v = self.value\n            print(end='')")
    assert _explore(_target(tmp_path, source), "--stall-seconds", "0.5") == ExitCode.INCONCLUSIVE
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out and "blocked outside the model" in out and "target.py:" in out


@pytest.mark.parametrize("start", [
    "t = threading.Thread(target=lambda: None)\n    t.start()\n    t.join()",
    "from concurrent.futures import ThreadPoolExecutor\n    ThreadPoolExecutor(2).submit(lambda: None)",
])
def test_threads_started_inside_a_body_are_inconclusive_with_a_sentence(tmp_path: Path, start: str, capsys) -> None:
    source = f"""
def body(s):
    {start}

def scenario():
    return Scenario("spawns", SimpleNamespace, (body, body), lambda s, r: None)
"""
    assert _explore(_target(tmp_path, source)) == ExitCode.INCONCLUSIVE
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out and "T0 at " in out and "KeyError" not in out
    assert "starts a thread" in out or "submits to a thread pool" in out


def test_async_body_is_inconclusive_not_a_false_bug(tmp_path: Path, capsys) -> None:
    source = """
async def body(s):
    s.n += 1

def scenario():
    return Scenario("async", lambda: SimpleNamespace(n=0), (body, body), lambda s, r: None if s.n == 2 else "lost")
"""
    assert _explore(_target(tmp_path, source)) == ExitCode.INCONCLUSIVE
    assert "async def" in capsys.readouterr().out


def test_an_infinite_loop_names_the_thread(tmp_path: Path, capsys) -> None:
    source = """
def forever(s):
    i = 0
    while True:
        i += 1

def scenario():
    return Scenario("forever", SimpleNamespace, (forever, forever), lambda s, r: None)
"""
    assert _explore(_target(tmp_path, source), "--max-bytecodes", "20000") == ExitCode.INCONCLUSIVE
    assert "T0 makes no progress: 20,000 bytecodes" in capsys.readouterr().out


def test_a_correct_spin_wait_is_inconclusive_quickly(tmp_path: Path, capsys) -> None:
    source = """
def waiter(s):
    while not s.flag:
        pass
    return s.data

def setter(s):
    s.data = 1
    s.flag = True

def scenario():
    return Scenario("spin", lambda: SimpleNamespace(flag=False, data=0), (waiter, setter),
                    lambda s, r: None if r[0] == 1 else f"read {r[0]}")
"""
    assert _explore(_target(tmp_path, source), "--switch", "gil", "--max-steps", "300") == ExitCode.INCONCLUSIVE
    assert "T0 makes no progress: 300 choice points" in capsys.readouterr().out


def test_a_sibling_import_resolves_and_its_bug_is_traced(tmp_path: Path, capsys) -> None:
    (tmp_path / "helpers_mod.py").write_text("def bump(box):\n    v = box.value\n    box.value = v + 1\n")
    source = """
import helpers_mod

def body(b):
    helpers_mod.bump(b)

def scenario():
    return Scenario("helper", lambda: SimpleNamespace(value=0), (body, body),
                    lambda b, r: None if b.value == 2 else f"lost update: {b.value}")
"""
    assert _explore(_target(tmp_path, source)) == ExitCode.BUG  # the helper is traced by default
    assert "lost update: 1" in capsys.readouterr().out


@pytest.mark.parametrize("source, target_suffix, message", [
    ("def scenario(:\n    pass\n", ":scenario", "syntax error"),
    ("scenario = 42\n", ":scenario", "is not a Scenario"),
    ("import no_such_module_here\n", ":scenario", "ModuleNotFoundError"),
    ("def scenario():\n    return Scenario('x', SimpleNamespace, (), lambda s, r: None)\n", ":scenario", "no threads"),
])
def test_target_errors_exit_2_with_one_sentence(tmp_path: Path, source: str, target_suffix: str, message: str,
                                                capsys) -> None:
    path = _target(tmp_path, source)
    assert main(["race", "explore", path + target_suffix]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.startswith("isolab: error: ") and err.count("\n") == 1 and message in err
    assert "Traceback" not in err


def test_setup_that_raises_is_a_target_error(tmp_path: Path, capsys) -> None:
    source = """
def boom():
    raise OSError("no database")

def scenario():
    return Scenario("boom", boom, (lambda s: None, lambda s: None), lambda s, r: None)
"""
    assert _explore(_target(tmp_path, source)) == ExitCode.USAGE
    assert "setup raised OSError: no database" in capsys.readouterr().err


def test_execution_budget_reached_is_inconclusive(capsys) -> None:
    assert main(["race", "explore", "passcode:lock_local", "--quiet", "--max-executions", "3"]) == ExitCode.INCONCLUSIVE
    assert "execution budget reached: 3 executions" in capsys.readouterr().out


def test_without_default_import_tracing_the_helper_bug_is_missed(tmp_path: Path, monkeypatch) -> None:
    from isolab.race.explorer import scope

    (tmp_path / "helpers_off.py").write_text("def bump(box):\n    v = box.value\n    box.value = v + 1\n")
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    source = """
import helpers_off

def body(b):
    helpers_off.bump(b)

def scenario():
    return Scenario("helper", lambda: SimpleNamespace(value=0), (body, body),
                    lambda b, r: None if b.value == 2 else f"lost update: {b.value}")
"""
    target = _target(sub, source)
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        assert _explore(target) == ExitCode.BUG  # traced through the import, though in another folder
        monkeypatch.setattr(scope, "closure", lambda modules, **kw: list(modules))  # the protection off
        assert _explore(target) == ExitCode.HOLDS
    finally:
        sys.path.remove(str(tmp_path))


def test_untraced_modules_are_listed_and_trace_module_adds_one(tmp_path: Path, capsys) -> None:
    source = """
from packaging.version import Version

def body(s):
    s.v = Version("1.0")

def scenario():
    return Scenario("pkg", SimpleNamespace, (body, body), lambda s, r: None)
"""
    target = _target(tmp_path, source)
    assert _explore(target, "--bound", "1") == ExitCode.HOLDS
    assert "not traced (add with --trace-module): packaging.version" in capsys.readouterr().out
    assert _explore(target, "--bound", "1", "--trace-module", "packaging.version") == ExitCode.HOLDS
    assert "packaging.version" not in capsys.readouterr().out


def test_time_limit_reached_is_inconclusive(capsys) -> None:
    assert main(["race", "explore", "passcode:lock_local", "--quiet", "--time-limit", "0.000001"]) == \
        ExitCode.INCONCLUSIVE
    assert "time limit reached: 1e-06s" in capsys.readouterr().out


def test_progress_reports_executions_distinct_states_and_elapsed() -> None:
    from isolab.race.explorer import search
    from isolab.race.explorer.strategies import BoundedStrategy
    from isolab.race.scenarios import passcode

    seen = []
    result = search(passcode("buggy"), BoundedStrategy(2), count_all=True, on_progress=seen.append,
                    progress_every=0.0)
    assert len(seen) >= result.executions - result.failures - 1
    assert [p.executions for p in seen] == sorted(p.executions for p in seen)
    assert seen[-1].distinct_states >= 2 and seen[-1].seconds > 0 and sum(seen[-1].per_bound.values()) > 0
