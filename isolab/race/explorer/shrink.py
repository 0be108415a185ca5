"""Owns making a losing schedule small and honest: delta debugging over its scheduling decisions,
and sliding each preemption the GIL could not take to a later point where it could. Does not
search (search.py) or save (schedule.py)."""

from __future__ import annotations

from isolab.race.explorer.runtime import run_once
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.strategies import LaxReplayChooser, decisions_of
from isolab.race.explorer.task import RunLimits
from isolab.race.explorer.types import Execution, SwitchMode


def shrink(scenario: Scenario, failing: Execution, mode: SwitchMode,
           limits: RunLimits | None = None) -> tuple[Execution, int]:
    """Drops each decision in turn and keeps the drop when the same kind of failure still happens
    with no more preemptions; repeats until no single drop works (1-minimal). Returns the
    smallest failing execution and the number of executions spent."""
    decisions = decisions_of(failing)
    best = failing
    spent = 0
    changed = True
    while changed:
        changed = False
        for key in list(decisions):
            trial = {k: v for k, v in decisions.items() if k != key}
            execution = run_once(scenario, LaxReplayChooser(trial), mode, limits=limits)
            spent += 1
            if execution.outcome == failing.outcome and execution.preemptions <= best.preemptions:
                decisions, best, changed = decisions_of(execution), execution, True
                break
    return best, spent


def slide_to_gil(scenario: Scenario, failing: Execution, mode: SwitchMode, tries: int = 8,
                 limits: RunLimits | None = None) -> tuple[Execution, int]:
    """Moves each preemption that CPython 3.11 could not take to a later point of the same thread
    where it could, keeping the move when the same failure still happens. A free-threaded-only
    label then means: no such move was found, not merely that the first schedule was unlucky."""
    best, spent = failing, 0
    for c in failing.points:
        if not c.preemptive or c.point.gil_ok:
            continue
        me = c.point.current if c.point.current is not None else -1
        key = (me, c.point.location, c.point.occurrence)
        decisions = decisions_of(best)
        if key not in decisions:
            continue
        rest = {k: v for k, v in decisions.items() if k != key}
        without = run_once(scenario, LaxReplayChooser(rest), mode, limits=limits)
        spent += 1
        later = [p.point for p in without.points
                 if p.point.current == c.point.current and p.point.gil_ok and p.point.index > c.point.index
                 and c.chosen in p.point.enabled][:tries]
        for p in later:
            trial = {**rest, (me, p.location, p.occurrence): c.chosen}
            execution = run_once(scenario, LaxReplayChooser(trial), mode, limits=limits)
            spent += 1
            if execution.outcome == failing.outcome and execution.preemptions <= best.preemptions:
                best = execution
                break
    return best, spent
