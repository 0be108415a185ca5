"""The explorer: the passcode race found with certainty, each fix verified within a stated bound
with its vacuity check, the four known-buggy fixtures caught, and the modelled primitives."""

from __future__ import annotations

import queue
import threading

import pytest

from isolab.race.checkers import FIXES, MUTANT_OF
from isolab.race.explorer import Scenario, SwitchMode, bounded_search, pct_search
from isolab.race.explorer.api import explore
from isolab.race.fixtures import SCENARIOS as FIXTURES
from isolab.race.scenarios import passcode

BOUND = 2  # the verification bound used throughout: every schedule with <= 2 preemptions


@pytest.mark.parametrize("mode", list(SwitchMode))
def test_passcode_race_found_with_one_preemption(mode: SwitchMode) -> None:
    result = bounded_search(passcode("buggy"), bound=BOUND, mode=mode)
    assert result.failure is not None
    assert result.failure.preemptions == 1  # fewest possible: 0 preemptions is sequential
    assert result.per_bound[0] >= 1 and result.executions <= 20


def test_passcode_race_is_reachable_with_the_gil_and_reported_as_false_accept() -> None:
    report = explore(passcode("buggy"), SwitchMode.OPCODE, bound=BOUND)
    assert report.finding is not None
    assert report.finding.gil_reachable
    assert "false accept" in (report.finding.execution.message or "")
    assert report.finding.execution.preemptions == 1


@pytest.mark.parametrize("fix", FIXES)
@pytest.mark.parametrize("mode", [SwitchMode.GIL, SwitchMode.OPCODE])
def test_fix_holds_within_bound_and_its_mutant_fails(fix: str, mode: SwitchMode) -> None:
    verified = bounded_search(passcode(fix), bound=BOUND, mode=mode)
    assert verified.failure is None and verified.exhausted and verified.step_limited == 0
    unreduced = bounded_search(passcode(fix), bound=BOUND, mode=mode, reduction=False)
    assert unreduced.failure is None and unreduced.exhausted
    assert unreduced.per_bound[BOUND] > 0  # the bound was really reached, not vacuously empty
    mutant = bounded_search(passcode(MUTANT_OF[fix]), bound=BOUND, mode=mode)
    assert mutant.failure is not None, f"vacuity: {MUTANT_OF[fix]} must lose"


def test_count_all_counts_losing_schedules() -> None:
    result = bounded_search(passcode("buggy"), bound=1, mode=SwitchMode.GIL, count_all=True)
    assert result.exhausted and 1 <= result.failures < result.executions


@pytest.mark.parametrize(
    "name, mode, outcome, gil",
    [
        ("lost_update", SwitchMode.OPCODE, "failed", False),
        ("deadlock", SwitchMode.OPCODE, "deadlock", False),  # no GIL switch point between the acquires
        ("check_then_act", SwitchMode.GIL, "failed", True),
        ("lost_wakeup", SwitchMode.GIL, "deadlock", True),
    ],
)
def test_known_buggy_fixture_is_caught_and_its_fix_holds(name: str, mode: SwitchMode, outcome: str, gil: bool) -> None:
    report = explore(FIXTURES[name](), mode, bound=BOUND)
    assert report.finding is not None
    assert report.finding.execution.outcome == outcome
    assert report.finding.gil_reachable is gil
    fixed = bounded_search(FIXTURES[f"{name}_fixed"](), bound=BOUND, mode=SwitchMode.OPCODE)
    assert fixed.failure is None and fixed.exhausted


def test_lost_update_needs_a_switch_the_gil_never_takes() -> None:
    gil = bounded_search(FIXTURES["lost_update"](), bound=BOUND, mode=SwitchMode.GIL)
    assert gil.failure is None and gil.exhausted
    report = explore(FIXTURES["lost_update"](), SwitchMode.OPCODE, bound=BOUND)
    assert report.finding is not None and report.finding.gil_search is not None
    assert report.finding.gil_search.failure is None


def test_deadlock_names_both_locks_by_their_attributes() -> None:
    result = bounded_search(FIXTURES["deadlock"](), bound=1, mode=SwitchMode.OPCODE)
    assert result.failure is not None
    assert result.failure.verdict == "deadlock: T0 waits for s.b held by T1; T1 waits for s.a held by T0"


def test_two_lock_deadlock_needs_a_switch_the_gil_never_takes() -> None:
    # `with s.a: with s.b:` has no eval-breaker check between the acquires (test_gil_model shows
    # real threads never deadlock there), so the GIL-faithful search must hold
    gil = bounded_search(FIXTURES["deadlock"](), bound=BOUND, mode=SwitchMode.GIL)
    assert gil.failure is None and gil.exhausted


def test_pct_finds_the_passcode_race_for_a_fixed_seed() -> None:
    result = pct_search(passcode("buggy"), seed=0, depth=2, runs=100, mode=SwitchMode.GIL)
    assert result.failure is not None
    again = pct_search(passcode("buggy"), seed=0, depth=2, runs=100, mode=SwitchMode.GIL)
    assert again.executions == result.executions  # a seed is a replay


# --- modelled primitives ------------------------------------------------------------------------
def _scenario(setup, *bodies, check=lambda s, r: None) -> Scenario:
    return Scenario("test", setup, tuple(bodies), check)


def test_queue_handoff_holds_and_a_missing_put_deadlocks() -> None:
    def put(q: queue.Queue) -> None:
        q.put(1)

    def get(q: queue.Queue) -> int:
        return q.get()

    def check(q, results) -> str | None:
        return None if results[1] == 1 else f"got {results[1]}"

    ok = bounded_search(_scenario(queue.Queue, put, get, check=check), bound=BOUND, mode=SwitchMode.GIL)
    assert ok.failure is None and ok.exhausted
    stuck = bounded_search(_scenario(queue.Queue, get, get), bound=0, mode=SwitchMode.GIL)
    assert stuck.failure is not None and stuck.failure.outcome == "deadlock"


def test_event_semaphore_and_rlock_are_modelled() -> None:
    class S:
        def __init__(self) -> None:
            self.event, self.sem, self.rlock, self.log = threading.Event(), threading.Semaphore(0), threading.RLock(), []

    def waiter(s: S) -> None:
        s.event.wait()
        s.sem.release()
        with s.rlock:
            with s.rlock:
                s.log.append("w")

    def setter(s: S) -> None:
        s.event.set()
        s.sem.acquire()
        s.log.append("s")

    def check(s: S, results) -> str | None:
        return None if sorted(s.log) == ["s", "w"] else f"log {s.log}"

    result = bounded_search(_scenario(S, waiter, setter, check=check), bound=BOUND, mode=SwitchMode.OPCODE)
    assert result.failure is None and result.exhausted
    starved = bounded_search(_scenario(S, setter), bound=0)  # acquires a semaphore nobody releases
    assert starved.failure is not None and starved.failure.verdict == "deadlock: T0 waits for s.sem (value 0)"


def test_real_primitives_are_restored_after_exploring() -> None:
    real_lock, real_event = threading.Lock, threading.Event
    bounded_search(FIXTURES["deadlock"](), bound=1)
    assert threading.Lock is real_lock and threading.Event is real_event
    assert type(threading.Lock()).__name__ == "lock"


def test_a_pct_finding_is_shrunk_to_the_fewest_preemptions() -> None:
    from isolab.race.explorer.search import search
    from isolab.race.explorer.strategies import PCTStrategy

    found = search(passcode("buggy"), PCTStrategy(2, seed=0, depth=3, runs=200), SwitchMode.OPCODE)
    assert found.failure is not None and found.failure.preemptions == 2  # delta debugging keeps both
    report = explore(passcode("buggy"), SwitchMode.OPCODE, strategy="pct", seed=0, depth=3, runs=200)
    assert report.finding is not None and report.finding.execution.preemptions == 1
