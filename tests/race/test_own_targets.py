"""The explorer on targets a user writes (found by a black-box QA pass, session 42): primitives used
in setup, check and watch; a check written with assert or returning a bool; scenarios that cannot
run as written; SystemExit anywhere; threads started in setup; races inside the standard library;
state that outlives setup. Each was a traceback, an empty message, a silent exit 0 or a wrong
verdict before."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from isolab.cli import main
from isolab.race.explorer.types import ExitCode

HEAD = "import collections, queue, threading\nfrom isolab.race.explorer import Scenario\n"
_names = itertools.count()


def explore(tmp_path: Path, code: str, name: str = "scenario", *extra: str) -> int:
    path = tmp_path / f"own_{next(_names)}.py"  # one module name per target: each file is imported once
    path.write_text(HEAD + code)
    return main(["race", "explore", f"{path}:{name}", "--quiet", *extra])


PRIMITIVES_OUTSIDE = '''
class S:
    def __init__(self):
        self.lock = threading.Lock()
        with self.lock:                    # setup takes a lock,
            self.n = 0
        self.q = queue.Queue()
        self.q.put(1)                      # fills a queue,
        self.ready = threading.Event()
        self.ready.set()                   # sets an event
        self.sem = threading.Semaphore(2)
        self.sem.acquire(); self.sem.release()

def body(s):
    s.ready.wait()
    with s.lock:
        s.n += 1

def check(s, results):
    with s.lock:                           # check takes the lock
        return None if s.n == 2 and s.q.qsize() == 1 else f"n={s.n}"

def watch(s):
    with s.lock:                           # and so does the watch
        return f"n={s.n}"

scenario = Scenario("prims", S, (body, body), check, watch=watch)
'''


def test_primitives_in_setup_check_and_watch_behave_as_plain_ones(tmp_path, capsys):
    assert explore(tmp_path, PRIMITIVES_OUTSIDE) == ExitCode.HOLDS, capsys.readouterr()


def test_a_check_waiting_for_a_lock_a_thread_kept_is_the_finding(tmp_path, capsys):
    """Only the preempted schedule leaks the lock: a check that would wait for it reports that
    schedule (a usage error would hide it), and names the holder."""
    code = '''
class S:
    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0

def body(s):
    n = s.count
    s.count = n + 1                         # a lost update ...
    if s.count == 1:
        s.lock.acquire(blocking=False)      # the first in takes the lock,
    elif s.count == 2:
        s.lock.release()                    # the second gives it back: ... and nobody does

def check(s, results):
    with s.lock:
        return None

scenario = Scenario("kept", S, (body, body), check)
'''
    assert explore(tmp_path, code) == ExitCode.BUG
    out = capsys.readouterr().out
    assert "check waits for" in out and "outside the threads" in out, out


COUNTER = '''
class S:
    def __init__(self):
        self.x = 0

def body(s):
    s.x += 1
'''


def test_a_check_with_assert_finds_the_race(tmp_path, capsys):
    code = COUNTER + '''
def check(s, results):
    assert s.x == 2, f"x={s.x}"

scenario = Scenario("asserted", S, (body, body), check)
'''
    assert explore(tmp_path, code) == ExitCode.BUG
    assert "check's assert failed: x=1" in capsys.readouterr().out


@pytest.mark.parametrize("returned", ["s.x == 2", "42"])
def test_a_check_that_returns_no_sentence_is_refused(tmp_path, capsys, returned):
    """True for 'fine' was read as a failure ('failed: True'), and False as a pass."""
    code = COUNTER + f"scenario = Scenario('boolish', S, (body, body), lambda s, r: {returned})\n"
    assert explore(tmp_path, code) == ExitCode.USAGE
    assert "return None when the run is right" in capsys.readouterr().err


@pytest.mark.parametrize(("scenario", "says"), [
    ("Scenario('dup', S, (body, body), lambda s, r: None, thread_names=('a', 'a'))", "are not all different"),
    ("Scenario('nc', S, (body, 3), lambda s, r: None)", "thread T1 is a int, not a function"),
    ("Scenario('ar', S, (lambda: None, body), lambda s, r: None)", "thread T0 must take one argument"),
    ("Scenario('gen', S, (gen, body), lambda s, r: None)", "thread T0 is a generator function"),
    ("Scenario('ck', S, (body, body), lambda s: None)", "check must take two arguments"),
])
def test_a_scenario_that_cannot_run_as_written_is_one_sentence(tmp_path, capsys, scenario, says):
    code = COUNTER + f"def gen(s):\n    yield s.x\n\nscenario = {scenario}\n"
    assert explore(tmp_path, code) == ExitCode.USAGE
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("where", "code", "code_then"), [
    ("import", "raise SystemExit(0)\n", ExitCode.USAGE),
    ("setup", COUNTER + "scenario = Scenario('se', lambda: exit(0), (body,), lambda s, r: None)\n", ExitCode.USAGE),
    ("check", COUNTER + "scenario = Scenario('ce', S, (body,), lambda s, r: exit(0))\n", ExitCode.USAGE),
    ("body", "import sys\nscenario = Scenario('be', lambda: None, (lambda s: sys.exit(0),), lambda s, r: None)\n",
     ExitCode.BUG),
])
def test_system_exit_is_never_a_silent_exit_0(tmp_path, capsys, where, code, code_then):
    assert explore(tmp_path, code) == code_then
    captured = capsys.readouterr()
    assert "SystemExit" in captured.out + captured.err, where


def test_a_thread_started_in_setup_is_one_sentence(tmp_path, capsys):
    code = COUNTER + '''
def setup():
    s = S()
    threading.Thread(target=lambda: None, daemon=True).start()
    return s

scenario = Scenario("st", setup, (body,), lambda s, r: None)
'''
    assert explore(tmp_path, code) == ExitCode.USAGE
    assert "threads started in setup are not modelled" in capsys.readouterr().err


STDLIB_RACE = '''
class S:
    def __init__(self):
        self.c = collections.Counter()

def body(s):
    s.c.update({"a": 1})

scenario = Scenario("ctr", S, (body, body), lambda s, r: None if s.c["a"] == 2 else f"a={s.c['a']}")
'''


def test_a_race_inside_the_standard_library_is_named_as_unexplored(tmp_path, capsys):
    """Counter.update loses updates under real threads; the explorer said HOLDS and named nothing."""
    assert explore(tmp_path, STDLIB_RACE) == ExitCode.HOLDS
    assert "called but not traced, so a race inside is not explored (add with --trace-module): collections" \
        in capsys.readouterr().out
    assert explore(tmp_path, STDLIB_RACE, "scenario", "--trace-module", "collections") == ExitCode.BUG


def test_state_that_outlives_setup_is_refused(tmp_path, capsys):
    """A module global never reset: each execution started where the last one stopped (a false
    FAILED with 0 preemptions, a replay that reproduced 0 of 3)."""
    code = '''
count = 0
lock = threading.Lock()

def inc(_s):
    global count
    with lock:
        count += 1

scenario = Scenario("glob", lambda: None, (inc, inc), lambda s, r: None if count == 2 else f"count={count}")
'''
    assert explore(tmp_path, code) == ExitCode.USAGE
    assert "is not repeatable: the same schedule, run twice, ended differently" in capsys.readouterr().err


def test_a_spent_budget_says_which_bounds_were_done(tmp_path, capsys):
    """INCONCLUSIVE said only 'execution budget reached'; the bounded search goes level by level, so
    every level below the one cut short was searched whole."""
    code = '''
class Account:
    def __init__(self, name, balance):
        self.name, self.balance, self.lock = name, balance, threading.Lock()

class Bank:
    def __init__(self):
        self.a, self.b = Account("a", 100), Account("b", 100)

def transfer(src, dst, amount):
    first, second = sorted((src, dst), key=lambda acct: acct.name)
    with first.lock:
        with second.lock:
            if src.balance >= amount:
                src.balance -= amount
                dst.balance += amount

scenario = Scenario("ordered", Bank, (lambda k: transfer(k.a, k.b, 10), lambda k: transfer(k.b, k.a, 20)),
                    lambda k, r: None if k.a.balance + k.b.balance == 200 else "money made or lost")
'''
    assert explore(tmp_path, code, "scenario", "--bound", "3", "--max-executions", "100") == ExitCode.INCONCLUSIVE
    out = capsys.readouterr().out
    assert "execution budget reached" in out and "every schedule with at most" in out and "cut short" in out, out


def test_a_package_target_is_found_in_the_current_folder(tmp_path, capsys, monkeypatch):
    """`isolab race explore mypkg.acct:scenario` from the package's folder: 'No module named mypkg'."""
    import sys

    pkg = tmp_path / "ownpkg42"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "acct.py").write_text(HEAD + STDLIB_RACE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["race", "explore", "ownpkg42.acct:scenario", "--quiet"]) == ExitCode.HOLDS
    assert "explore ctr" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "says"), [
    (["passcode:buggy", "--seed", "3"], "--seed is read only with --strategy pct"),
    (["passcode:buggy", "--runs", "5"], "--runs is read only with --strategy pct"),
    (["passcode:buggy", "--times", "3"], "--times is read only with --replay"),
    (["passcode:buggy", "--strategy", "pct", "--bound", "3"], "--bound is read only with --strategy bounded"),
    (["passcode:buggy", "--list"], "--list prints the built-in targets"),
    (["--list", "--seed", "4"], "--list prints the built-in targets"),
])
def test_flags_the_mode_would_ignore_are_refused(capsys, flags, says):
    assert main(["race", "explore", *flags]) == ExitCode.USAGE
    assert says in capsys.readouterr().err


def test_results_and_watches_that_vary_do_not_make_a_target_unrepeatable(tmp_path, capsys):
    """Only the verdict must repeat: a body returning a clock, or a watch returning an int, was refused
    (or a TypeError traceback) by the first form of the repeatability check."""
    code = COUNTER.replace("    s.x += 1", "    with s.lock:\n        s.x += 1\n    return time.monotonic()") + '''
import time

def make():
    s = S()
    s.lock = threading.Lock()
    return s

scenario = Scenario("clock", make, (body, body), lambda s, r: None if s.x == 2 else f"x={s.x}", watch=lambda s: s.x)
'''
    assert explore(tmp_path, code) == ExitCode.HOLDS, capsys.readouterr()


def test_a_watch_inside_a_thread_reads_a_condition_as_a_plain_one(tmp_path, capsys):
    """The narrative's watch runs inside a thread's step: a Condition used there failed with
    'cannot notify on un-acquired lock' on every line."""
    code = '''
class S:
    def __init__(self):
        self.cond = threading.Condition()
        self.x = 0

def body(s):
    s.x += 1

def watch(s):
    with s.cond:
        s.cond.notify_all()
        return f"x={s.x}"

scenario = Scenario("condwatch", S, (body, body), lambda s, r: None if s.x == 2 else f"x={s.x}", watch=watch)
'''
    assert explore(tmp_path, code) == ExitCode.BUG
    out = capsys.readouterr().out
    assert "x=1" in out and "<RuntimeError>" not in out, out


def test_a_budget_spent_on_the_last_schedule_is_a_whole_search(capsys):
    """passcode:immutable has 6 schedules within bound 2: a budget of 6 searched them all (it said
    INCONCLUSIVE, '1 preemptions: cut short'); 5 leaves one out."""
    assert main(["race", "explore", "passcode:immutable", "--quiet", "--max-executions", "6"]) == ExitCode.HOLDS
    assert "every schedule within the bound passed: 6 executions" in capsys.readouterr().out
    assert main(["race", "explore", "passcode:immutable", "--quiet", "--max-executions", "5"]) == ExitCode.INCONCLUSIVE
    assert "cut short" in capsys.readouterr().out


def test_a_pct_search_that_holds_says_why_it_ran_one_more_execution_than_runs(capsys):
    """--runs 5 reported "6 executions" with no word of the run that counts the choice points."""
    assert main(["race", "explore", "fixtures:lost_update_fixed", "--strategy", "pct", "--runs", "5"]) == ExitCode.HOLDS
    assert "6 executions (1 to count the choice points, then the PCT runs)" in capsys.readouterr().out
