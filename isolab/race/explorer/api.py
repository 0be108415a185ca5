"""Owns the one-call Python API behind `isolab race explore`: search, then (on a failure) shrink,
label, record the narrative and build the schedule. Printing is the CLI's job."""

from __future__ import annotations

from dataclasses import dataclass

from isolab.race.explorer.runtime import Execution, SwitchMode, run_once
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.schedule import Schedule, from_execution
from isolab.race.explorer.strategies import (
    LaxReplayChooser,
    SearchResult,
    bounded_search,
    decisions_of,
    pct_search,
    shrink,
    slide_to_gil,
)


@dataclass(frozen=True)
class Finding:
    execution: Execution  # the shrunk failing execution, recorded (narrative steps filled in)
    schedule: Schedule
    decisions_before: int  # non-default choices in the schedule the search found
    decisions_after: int  # ... after shrinking
    shrink_executions: int
    gil_reachable: bool  # every preemption sits where CPython 3.11 with the GIL can switch
    gil_search: SearchResult | None  # when not: does a GIL-faithful search find it anyway?


@dataclass(frozen=True)
class ExploreReport:
    search: SearchResult
    finding: Finding | None

    @property
    def failed(self) -> bool:
        return self.finding is not None


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
) -> ExploreReport:
    if strategy == "bounded":
        search = bounded_search(scenario, bound, mode, count_all=count_all)
    else:
        search = pct_search(scenario, seed=seed, depth=depth, runs=runs, mode=mode)
    if search.failure is None:
        return ExploreReport(search, None)
    failing = search.failure
    before = len(decisions_of(failing))
    spent = 0
    if do_shrink:
        failing, spent = shrink(scenario, failing, mode)
        if not failing.gil_reachable and mode is not SwitchMode.GIL:
            failing, more = slide_to_gil(scenario, failing, mode)
            spent += more
    recorded = run_once(scenario, LaxReplayChooser(decisions_of(failing)), mode, record=True)
    assert recorded.outcome == failing.outcome, "a shrunk schedule must replay to the same outcome"
    gil_search = None
    if not recorded.gil_reachable and mode is not SwitchMode.GIL:
        gil_search = bounded_search(scenario, bound, SwitchMode.GIL)
    finding = Finding(
        recorded, from_execution(scenario, mode, recorded), before, len(decisions_of(recorded)), spent,
        recorded.gil_reachable, gil_search,
    )
    return ExploreReport(search, finding)
