"""Owns what `isolab race explore` prints: the search summary, the minimal losing schedule's
narrative, its GIL label, and the replay verdict. Logic lives in explorer.api / schedule."""

from __future__ import annotations

import argparse
from pathlib import Path

from isolab.race.explorer import narrative
from isolab.race.explorer.api import ExploreReport, explore
from isolab.race.explorer.runtime import SwitchMode
from isolab.race.explorer.scenario import load
from isolab.race.explorer.schedule import load as load_schedule
from isolab.race.explorer.schedule import replay, save


def summary(report: ExploreReport) -> list[str]:
    s = report.search
    levels = ", ".join(f"{b} preemptions: {n}" for b, n in s.per_bound.items() if n)
    head = f"explore {s.scenario}  switch={s.mode}  strategy={s.strategy}"
    lines = [head]
    if report.finding is None:
        scope = "every schedule within the bound" if s.exhausted else "the schedules tried"
        lines.append(f"HOLDS: {scope} passed: {s.executions} executions in {s.seconds:.2f}s "
                     f"({s.executions_per_second:.0f}/s){'; ' + levels if levels else ''}")
        if s.step_limited:
            lines.append(f"  note: {s.step_limited} executions hit the choice-point limit (inconclusive)")
        return lines
    f = report.finding
    ex = f.execution
    if s.failures > 1 or s.exhausted:
        lines.append(f"losing schedules within the bound: {s.failures} of {s.executions}")
    lines.append(f"FAILED after {s.executions} executions in {s.seconds:.2f}s ({levels})")
    lines.append(f"  {ex.outcome}: {ex.message}")
    label = "reachable with the GIL" if f.gil_reachable else "free-threaded only (a preemption falls where CPython 3.11 cannot switch)"
    lines.append(f"  preemptions: {ex.preemptions}; {label}")
    if f.gil_search is not None:
        g = f.gil_search
        verdict = (f"a GIL-faithful search also fails ({g.failure.message}) after {g.executions} executions"
                   if g.failure else f"a GIL-faithful search holds: {g.executions} executions, {g.strategy}")
        lines.append(f"  {verdict}")
    lines.append(f"  shrunk: {f.decisions_before} -> {f.decisions_after} scheduling decisions "
                 f"({f.shrink_executions} more executions)")
    return lines


def run_explore(args: argparse.Namespace) -> int:
    scenario = load(args.target)
    report = explore(scenario, SwitchMode(args.switch), args.bound, args.strategy, args.seed, args.runs,
                     args.depth, args.count_all, not args.no_shrink)
    print("\n".join(summary(report)))
    if report.finding is None:
        return 0
    print()
    print(narrative.render(report.finding.execution, scenario.names))
    if args.save:
        save(args.save, report.finding.schedule)
        print(f"\nschedule saved to {args.save}; replay: isolab race explore {scenario.name} --replay {args.save}")
    return 1


def run_replay(target: str | None, path: Path, times: int) -> int:
    schedule = load_schedule(path)
    scenario = load(target or schedule.scenario)
    result = replay(scenario, schedule, times)
    print(f"replay {path} on {scenario.name} (switch={schedule.switch}): "
          f"reproduced {result.reproduced} of {result.runs}  [saved outcome: {schedule.outcome}]")
    if result.changed_sources:
        print(f"  source changed since the schedule was saved: {', '.join(result.changed_sources)}")
    if result.divergence:
        print(f"  first divergence: {result.divergence}")
    print()
    print(narrative.render(result.last, scenario.names))
    return 1 if result.last.failed else 0
