"""Owns the search: which schedules to run and in what order. Each strategy is a `Chooser` fed
to one execution at a time; none of them knows about threads or bytecode.

    bounded   iterative preemption bounding (CHESS): every schedule with 0 preemptions, then 1,
              then 2 ... up to the bound, exhaustive within it; the first failure found therefore
              has the fewest preemptions possible.
    pct       Probabilistic Concurrency Testing: random thread priorities and depth-1 priority
              change points; a bug of depth d is hit with p >= 1/(n k^(d-1)) per run.
    replay    follow a saved schedule step by step (strict) or only its switches (lax, used to
              shrink).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from isolab.race.explorer.runtime import Execution, PendingPoint, SwitchMode, run_once
from isolab.race.explorer.scenario import Scenario


class PrefixChooser:
    """Follows a list of choices, then never preempts."""

    def __init__(self, prefix: list[int]) -> None:
        self.prefix = prefix

    def choose(self, point: PendingPoint) -> int:
        if point.index < len(self.prefix):
            return self.prefix[point.index]
        return point.default


class PCTChooser:
    def __init__(self, seed: int, num_threads: int, depth: int, num_points: int) -> None:
        rng = random.Random(seed)
        order = list(range(num_threads))
        rng.shuffle(order)
        # higher runs first; initial priorities sit above every change-point priority
        self.priority = {t: depth + rank for rank, t in enumerate(order)}
        k = max(num_points, depth)
        self.change_at = dict(
            (at, depth - 1 - i) for i, at in enumerate(sorted(rng.sample(range(1, k + 1), depth - 1)))
        )

    def choose(self, point: PendingPoint) -> int:
        if point.index in self.change_at and point.current is not None:
            self.priority[point.current] = self.change_at[point.index]
        return max(point.enabled, key=lambda t: self.priority[t])


Key = tuple[int, str, int]  # (thread, location, occurrence): where a decision is taken


class LaxReplayChooser:
    """Applies the recorded decisions where their (thread, location, occurrence) comes up;
    anything else takes the default. Used to shrink."""

    def __init__(self, decisions: dict[Key, int]) -> None:
        self.decisions = decisions

    def choose(self, point: PendingPoint) -> int:
        key = (point.current if point.current is not None else -1, point.location, point.occurrence)
        chosen = self.decisions.get(key)
        return chosen if chosen is not None and chosen in point.enabled else point.default


def decisions_of(execution: Execution) -> dict[Key, int]:
    """The choices that differ from the default, keyed by where they are taken."""
    out: dict[Key, int] = {}
    for c in execution.points:
        p = c.point
        if c.chosen != p.default:
            out[(p.current if p.current is not None else -1, p.location, p.occurrence)] = c.chosen
    return out


@dataclass(frozen=True)
class SearchResult:
    scenario: str
    mode: str
    strategy: str  # "bounded(2)" or "pct(seed=1, depth=2, runs=100)"
    executions: int  # executions run (including the failing one)
    seconds: float
    exhausted: bool  # every schedule within the bound was run (bounded only)
    per_bound: dict[int, int]  # executions run per preemption count
    step_limited: int  # executions cut short by the choice-point limit (inconclusive)
    failure: Execution | None  # the first failing execution, fewest preemptions first
    failures: int  # failing executions seen (all of them when count_all)

    @property
    def executions_per_second(self) -> float:
        return self.executions / self.seconds if self.seconds > 0 else float("inf")


def bounded_search(
    scenario: Scenario,
    bound: int = 2,
    mode: SwitchMode = SwitchMode.OPCODE,
    count_all: bool = False,
    max_executions: int = 100_000,
    on_execution: Callable[[Execution], None] | None = None,
) -> SearchResult:
    """Iterative preemption bounding. A schedule is its list of choices; a child deviates from
    its parent's default at one point past the parent's prefix, so each runs exactly once."""
    start = time.perf_counter()
    queues: list[deque[list[int]]] = [deque() for _ in range(bound + 1)]
    queues[0].append([])
    executions = failures = step_limited = 0
    per_bound = {b: 0 for b in range(bound + 1)}
    first: Execution | None = None
    for level in range(bound + 1):
        while queues[level]:
            if executions >= max_executions:
                break
            prefix = queues[level].popleft()
            execution = run_once(scenario, PrefixChooser(prefix), mode)
            executions += 1
            per_bound[level] += 1
            if on_execution is not None:
                on_execution(execution)
            if execution.outcome == "step_limit":
                step_limited += 1
            if execution.outcome == "hung":
                raise RuntimeError(execution.message)
            if execution.failed:
                failures += 1
                if first is None:
                    first = execution
                if not count_all:
                    return SearchResult(scenario.name, mode.value, f"bounded({bound})", executions,
                                        time.perf_counter() - start, False, per_bound, step_limited, first, failures)
            choices = [c.chosen for c in execution.points]
            preemptions = 0
            for i, c in enumerate(execution.points):
                if i >= len(prefix):
                    for alt in c.point.enabled:
                        if alt == c.chosen:
                            continue
                        cost = preemptions + (1 if c.point.current_enabled and alt != c.point.current else 0)
                        if cost <= bound:
                            queues[cost].append(choices[:i] + [alt])
                if c.preemptive:
                    preemptions += 1
    exhausted = executions < max_executions or not any(queues)
    return SearchResult(scenario.name, mode.value, f"bounded({bound})", executions, time.perf_counter() - start,
                        exhausted, per_bound, step_limited, first, failures)


def pct_search(
    scenario: Scenario, seed: int = 0, depth: int = 2, runs: int = 200, mode: SwitchMode = SwitchMode.OPCODE
) -> SearchResult:
    start = time.perf_counter()
    probe = run_once(scenario, PrefixChooser([]), mode)
    num_points = max(len(probe.points), 1)
    executions, step_limited, failures, first = 1, 0, 0, None
    if probe.failed:
        failures, first = 1, probe
    for r in range(runs):
        if first is not None:
            break
        execution = run_once(scenario, PCTChooser(seed + r, len(scenario.threads), depth, num_points), mode)
        executions += 1
        step_limited += execution.outcome == "step_limit"
        if execution.failed:
            failures, first = failures + 1, execution
    return SearchResult(scenario.name, mode.value, f"pct(seed={seed}, depth={depth}, runs={runs})", executions,
                        time.perf_counter() - start, False, {}, step_limited, first, failures)


def shrink(scenario: Scenario, failing: Execution, mode: SwitchMode) -> tuple[Execution, int]:
    """Delta debugging over the failing schedule's decisions: drop each one in turn and keep the
    drop when the same kind of failure still happens. Returns the smallest failing execution and
    the number of executions spent."""
    decisions = decisions_of(failing)
    best = failing
    spent = 0
    changed = True
    while changed:
        changed = False
        for key in list(decisions):
            trial = {k: v for k, v in decisions.items() if k != key}
            execution = run_once(scenario, LaxReplayChooser(trial), mode)
            spent += 1
            if execution.outcome == failing.outcome and execution.preemptions <= best.preemptions:
                decisions, best, changed = decisions_of(execution), execution, True
                break
    return best, spent


def slide_to_gil(scenario: Scenario, failing: Execution, mode: SwitchMode, tries: int = 8) -> tuple[Execution, int]:
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
        without = run_once(scenario, LaxReplayChooser(rest), mode)
        spent += 1
        later = [p.point for p in without.points
                 if p.point.current == c.point.current and p.point.gil_ok and p.point.index > c.point.index
                 and c.chosen in p.point.enabled][:tries]
        for p in later:
            trial = {**rest, (me, p.location, p.occurrence): c.chosen}
            execution = run_once(scenario, LaxReplayChooser(trial), mode)
            spent += 1
            if execution.outcome == failing.outcome and execution.preemptions <= best.preemptions:
                best = execution
                break
    return best, spent
