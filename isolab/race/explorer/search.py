"""Owns the one search driver: run the strategy's schedules one execution at a time within the
execution and time budgets, report progress, stop at the first bug (or count them all) and at
the first inconclusive execution, and say which of three verdicts the search reached. Does not
know which schedules a strategy picks (strategies.py) nor how an execution runs (runtime.py).

    HOLDS         no bug in every schedule the strategy covers (bounded: all within the bound)
    FAILED        a losing schedule (the first found; with `bounded`, one of the fewest preemptions)
    INCONCLUSIVE  a budget ran out first, or an execution could not be judged (reason named)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from isolab.race.explorer.runtime import run_once
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.strategies import BoundedStrategy, PCTStrategy, Strategy
from isolab.race.explorer.task import RunLimits
from isolab.race.explorer.types import Execution, ExitCode, Outcome, SwitchMode


class Verdict(StrEnum):
    HOLDS = "holds"
    FAILED = "failed"
    INCONCLUSIVE = "inconclusive"

    @property
    def exit_code(self) -> ExitCode:
        return {Verdict.HOLDS: ExitCode.HOLDS, Verdict.FAILED: ExitCode.BUG,
                Verdict.INCONCLUSIVE: ExitCode.INCONCLUSIVE}[self]


@dataclass(frozen=True)
class SearchLimits:
    max_executions: int = 100_000
    time_limit: float | None = None  # seconds of searching (shrinking afterwards not counted)
    run: RunLimits = field(default_factory=RunLimits)

    def __post_init__(self) -> None:
        if self.max_executions < 1:
            raise ValueError("max_executions must be at least 1")
        if self.time_limit is not None and self.time_limit <= 0:
            raise ValueError("time_limit must be positive")


@dataclass(frozen=True)
class Progress:
    executions: int
    distinct_states: int  # distinct (outcome, results, watched value) at the end of an execution
    seconds: float
    per_bound: dict[int, int]


@dataclass(frozen=True)
class SearchResult:
    scenario: str
    mode: str
    strategy: str  # "bounded(2)" or "pct(seed=1, depth=2, runs=100)"
    executions: int  # executions run (including the failing one)
    seconds: float
    exhausted: bool  # every schedule the strategy covers was run
    per_bound: dict[int, int]  # executions run per preemption count
    failure: Execution | None  # the first failing execution, fewest preemptions first
    failures: int  # failing executions seen (all of them when count_all)
    inconclusive: Execution | None = None  # the execution that could not be judged, if one
    stopped: str | None = None  # the budget that ended the search early
    distinct_states: int = 0

    @property
    def step_limited(self) -> int:
        return int(self.inconclusive is not None)

    @property
    def verdict(self) -> Verdict:
        if self.failure is not None:
            return Verdict.FAILED
        if self.inconclusive is not None or self.stopped is not None:
            return Verdict.INCONCLUSIVE
        return Verdict.HOLDS

    @property
    def reason(self) -> str | None:
        """Why the verdict is inconclusive, in one sentence."""
        if self.failure is not None:
            return None
        if self.inconclusive is not None:
            return f"{self.inconclusive.outcome.value}: {self.inconclusive.message}"
        return self.stopped

    @property
    def executions_per_second(self) -> float:
        return self.executions / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class _Tally:
    """What the driver has seen so far."""

    executions: int = 0
    failures: int = 0
    first: Execution | None = None  # the first failing execution
    inconclusive: Execution | None = None
    states: set[tuple[str, str, str]] = field(default_factory=set)

    def add(self, execution: Execution, count_all: bool) -> bool:
        """Counts one execution; True when the search stops at it."""
        self.executions += 1
        if execution.outcome is not Outcome.REDUNDANT:
            self.states.add((execution.outcome.value, _short_repr(execution.results), execution.final))
        if execution.outcome.is_inconclusive:
            self.inconclusive = execution
            return True
        if execution.failed:
            self.failures += 1
            self.first = self.first or execution
            return not count_all
        return False


def _budget_spent(limits: SearchLimits, executions: int, elapsed: float) -> str | None:
    """Which budget ran out, in words; None while both last."""
    if executions >= limits.max_executions:
        return f"execution budget reached: {executions:,} executions"
    if limits.time_limit is not None and elapsed >= limits.time_limit:
        return f"time limit reached: {limits.time_limit:g}s, {executions:,} executions"
    return None


def search(
    scenario: Scenario,
    strategy: Strategy,
    mode: SwitchMode = SwitchMode.OPCODE,
    limits: SearchLimits | None = None,
    count_all: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    progress_every: float = 1.0,
    on_execution: Callable[[Execution], None] | None = None,
) -> SearchResult:
    """Runs `strategy`'s schedules, one execution each, until it has none left, a budget runs
    out, an execution is inconclusive or (unless count_all) one fails."""
    limits = limits or SearchLimits()
    start = time.perf_counter()
    next_report = start + progress_every
    tally = _Tally()
    while (stopped := _budget_spent(limits, tally.executions, time.perf_counter() - start)) is None:
        chooser = strategy.next()
        if chooser is None:
            break
        execution = run_once(scenario, chooser, mode, limits=limits.run)
        strategy.observe(execution)
        if on_execution is not None:
            on_execution(execution)
        if tally.add(execution, count_all):
            break
        now = time.perf_counter()
        if on_progress is not None and now >= next_report:
            on_progress(Progress(executions=tally.executions, distinct_states=len(tally.states),
                                 seconds=now - start, per_bound=dict(strategy.per_bound)))
            next_report = now + progress_every
    if tally.first is not None:
        stopped = None  # a bug found is a verdict, whatever budget ran out afterwards
    if stopped is not None and strategy.exhausted:
        stopped = None  # the budget ran out as the last schedule ended: nothing was left unexplored
    return SearchResult(
        scenario=scenario.name,
        mode=mode.value,
        strategy=strategy.label,
        executions=tally.executions,
        seconds=time.perf_counter() - start,
        exhausted=strategy.exhausted and stopped is None and tally.inconclusive is None,
        per_bound=dict(strategy.per_bound),
        failure=tally.first,
        failures=tally.failures,
        inconclusive=tally.inconclusive,
        stopped=stopped,
        distinct_states=len(tally.states),
    )


def _short_repr(results: tuple) -> str:
    try:
        return repr(results)[:200]
    except Exception:  # a result whose repr fails still counts as one state
        return "<unrepresentable>"


def bounded_search(
    scenario: Scenario,
    bound: int = 2,
    mode: SwitchMode = SwitchMode.OPCODE,
    count_all: bool = False,
    max_executions: int = 100_000,
    on_execution: Callable[[Execution], None] | None = None,
    limits: SearchLimits | None = None,
    reduction: bool = True,
) -> SearchResult:
    """Iterative preemption bounding up to `bound` preemptions: search() over a BoundedStrategy."""
    limits = limits or SearchLimits(max_executions=max_executions)
    return search(scenario, BoundedStrategy(bound, reduction), mode, limits, count_all, on_execution=on_execution)


def pct_search(scenario: Scenario, seed: int = 0, depth: int = 2, runs: int = 200,
               mode: SwitchMode = SwitchMode.OPCODE, limits: SearchLimits | None = None) -> SearchResult:
    """`runs` PCT runs from `seed`: search() over a PCTStrategy."""
    return search(scenario, PCTStrategy(len(scenario.threads), seed, depth, runs), mode, limits)
