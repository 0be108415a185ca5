"""Owns the one-call Python API behind `isolab race explore`: search, then (on a failure) shrink,
label, record the narrative and build the schedule. Printing is the CLI's job."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from isolab.errors import InvalidRequestError
from isolab.race.explorer import gil
from isolab.race.explorer.runtime import run_once
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.schedule import Schedule, from_execution
from isolab.race.explorer.search import Progress, SearchLimits, SearchResult, Verdict, bounded_search, search
from isolab.race.explorer.shrink import shrink, slide_to_gil
from isolab.race.explorer.strategies import BoundedStrategy, LaxReplayChooser, PCTStrategy, decisions_of
from isolab.race.explorer.types import Execution, Outcome, SwitchMode


@dataclass(frozen=True)
class Finding:
    execution: Execution  # the shrunk failing execution, recorded (narrative steps filled in)
    schedule: Schedule
    decisions_before: int  # non-default choices in the schedule the search found
    decisions_after: int  # ... after shrinking
    shrink_executions: int
    gil_reachable: bool  # this schedule, or one a GIL-faithful search found, loses under the GIL
    gil_search: SearchResult | None  # when this schedule is not GIL-faithful: the GIL-faithful search


_NOT_REPEATABLE = ("{name} is not repeatable: {what}. Each execution must start from what setup builds; "
                   "state that outlives it (a module global, a class attribute, a cache) carries one execution "
                   "into the next: build or reset it in setup")


def _check_repeatable(scenario: Scenario, mode: SwitchMode, limits: SearchLimits) -> None:
    """The schedule without preemptions, run twice, must end alike: a search over executions that
    leak into each other reports races that are not there, and misses ones that are."""
    first = run_once(scenario, LaxReplayChooser({}), mode, limits=limits.run)
    if first.outcome not in (Outcome.OK, Outcome.FAILED):
        return  # (a deadlock, a stall: the search says so; a stall would cost its wait again)
    second = run_once(scenario, LaxReplayChooser({}), mode, limits=limits.run)

    def seen(e: Execution) -> tuple[str, str]:  # what a verdict rests on (results may hold a clock, an ident)
        return e.outcome.value, _scrub(e.message or "")

    if seen(first) != seen(second):
        a, b = seen(first), seen(second)
        diff = next(f"{k}: {x} then {y}" for k, x, y in zip(("outcome", "message"), a, b, strict=True) if x != y)
        raise InvalidRequestError(_NOT_REPEATABLE.format(name=scenario.name, what=f"the same schedule, run twice, "
                                                         f"ended differently ({diff})"))


def _scrub(text: str) -> str:
    """Without object addresses (`<X object at 0x7f...>` differs each run and means nothing here)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


@dataclass(frozen=True)
class ExploreReport:
    search: SearchResult
    finding: Finding | None
    untraced: tuple[str, ...] = ()  # modules the bodies reach that were not traced
    reached: tuple[str, ...] = ()  # modules the executions called into untraced (standard library, run-time imports)

    @property
    def failed(self) -> bool:
        return self.finding is not None

    @property
    def verdict(self) -> Verdict:
        return self.search.verdict


def explore(
    scenario: Scenario,
    mode: SwitchMode = SwitchMode.OPCODE,
    bound: int = 2,
    strategy: str = "bounded",
    seed: int = 0,
    runs: int = 200,
    depth: int = 2,
    count_all: bool = False,
    do_shrink: bool = True,
    limits: SearchLimits | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> ExploreReport:
    gil.check_supported()
    limits = limits or SearchLimits()
    chosen = BoundedStrategy(bound) if strategy == "bounded" else PCTStrategy(len(scenario.threads), seed, depth, runs)
    _check_repeatable(scenario, mode, limits)
    result = search(scenario, chosen, mode, limits, count_all, on_progress)
    untraced = scenario.untraced()
    if result.failure is None:
        return ExploreReport(search=result, finding=None, untraced=untraced, reached=scenario.reached_untraced())
    failing = result.failure
    before = len(decisions_of(failing))
    spent = 0
    if do_shrink and strategy != "bounded" and failing.preemptions > 1:
        # PCT's schedule may preempt more than it needs: look for the fewest preemptions first
        fewer = bounded_search(scenario, failing.preemptions - 1, mode,
                               limits=SearchLimits(max_executions=min(limits.max_executions, 5_000), run=limits.run))
        spent += fewer.executions
        if fewer.failure is not None:
            failing = fewer.failure
    if do_shrink:
        failing, spent = shrink(scenario, failing, mode, limits.run)
        if not failing.gil_reachable and mode is not SwitchMode.GIL:
            failing, more = slide_to_gil(scenario, failing, mode, limits=limits.run)
            spent += more
    recorded = run_once(scenario, LaxReplayChooser(decisions_of(failing)), mode, record=True, limits=limits.run)
    if recorded.outcome != failing.outcome:
        raise InvalidRequestError(_NOT_REPEATABLE.format(name=scenario.name, what=f"a failing schedule, run again, "
                                                         f"ended {recorded.outcome.value}"))
    gil_search = None
    reachable = recorded.gil_reachable
    if not reachable and mode is not SwitchMode.GIL:
        gil_search = bounded_search(scenario, bound, SwitchMode.GIL, limits=limits)
        reachable = gil_search.failure is not None and gil_search.failure.outcome == recorded.outcome
    finding = Finding(execution=recorded, schedule=from_execution(scenario, mode, recorded),
                      decisions_before=before, decisions_after=len(decisions_of(recorded)),
                      shrink_executions=spent, gil_reachable=reachable, gil_search=gil_search)
    return ExploreReport(search=result, finding=finding, untraced=untraced, reached=scenario.reached_untraced())
