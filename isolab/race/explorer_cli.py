"""Owns what `isolab race explore` prints: the search summary and verdict, the minimal losing
schedule's narrative, its GIL label, what was not traced, progress on stderr, and the replay
verdict. Logic lives in explorer.api / search / schedule. Exit codes: explorer.types.ExitCode."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from isolab.race.explorer import gil, narrative
from isolab.race.explorer.api import ExploreReport, explore
from isolab.race.explorer.scenario import load
from isolab.race.explorer.schedule import absolute_target, replay, save
from isolab.race.explorer.schedule import load as load_schedule
from isolab.race.explorer.search import Progress, SearchLimits, Verdict
from isolab.race.explorer.task import RunLimits
from isolab.race.explorer.types import ExitCode, SwitchMode


def summary(report: ExploreReport, shrunk: bool = True) -> list[str]:
    s = report.search
    levels = ", ".join(f"{b} preemptions: {n}" for b, n in s.per_bound.items() if n)
    lines = [f"explore {s.scenario}  switch={s.mode}  strategy={s.strategy}"]
    if report.finding is None:
        if s.verdict is Verdict.INCONCLUSIVE:
            lines.append(f"INCONCLUSIVE after {_n(s.executions, 'execution')} in {s.seconds:.2f}s: {s.reason}")
            top = max((b for b, n in s.per_bound.items() if n), default=0)
            if s.stopped is not None and s.strategy.startswith("bounded") and top > 0:
                # the bounded search goes level by level: a budget spent at `top` leaves every level below done
                lines.append(f"  every schedule with at most {_n(top - 1, 'preemption')} passed ({levels}; "
                             f"{top} preemptions: cut short)")
        else:
            scope = "every schedule within the bound" if s.exhausted else "the schedules tried"
            # (PCT: one run without preemptions counts the choice points, then --runs runs: say so, or
            # "6 executions" for --runs 5 reads as an off-by-one)
            pct = " (1 to count the choice points, then the PCT runs)" if s.strategy.startswith("pct") else ""
            lines.append(f"HOLDS: {scope} passed: {_n(s.executions, 'execution')}{pct} in {s.seconds:.2f}s "
                         f"({s.executions_per_second:.0f}/s){'; ' + levels if levels else ''}")
        lines += _untraced(report)
        return lines
    f = report.finding
    ex = f.execution
    if s.failures > 1 or s.exhausted:
        where = "schedules within the bound" if s.strategy.startswith("bounded") else "runs"
        lines.append(f"losing {where}: {s.failures} of {s.executions}")
    lines.append(f"FAILED after {_n(s.executions, 'execution')} in {s.seconds:.2f}s" + (f" ({levels})" if levels else ""))
    lines.append(f"  {ex.verdict}")
    if ex.gil_reachable:
        label = "reachable with the GIL"
    elif f.gil_reachable:
        label = "this schedule needs a free-threaded switch, but a GIL-faithful schedule loses the same way"
    else:
        label = "free-threaded only (a preemption falls where CPython 3.11 cannot switch)"
    lines.append(f"  preemptions: {ex.preemptions}; {label}")
    if f.gil_search is not None:
        g = f.gil_search
        verdict = (f"a GIL-faithful search also fails ({g.failure.message}) after {g.executions} executions"
                   if g.failure else f"a GIL-faithful search {g.verdict.value}: {g.executions} executions, {g.strategy}")
        lines.append(f"  {verdict}")
    if shrunk:
        lines.append(f"  shrunk: {f.decisions_before} -> {f.decisions_after} scheduling decisions "
                     f"({_n(f.shrink_executions, 'more execution')})")
    else:
        lines.append(f"  not shrunk (--no-shrink): {_n(f.decisions_before, 'scheduling decision')}")
    return lines + _untraced(report)


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _untraced(report: ExploreReport) -> list[str]:
    lines = [f"  not traced (add with --trace-module): {', '.join(report.untraced)}"] if report.untraced else []
    if report.reached:  # (a Counter.update race held: the standard library was never named)
        lines.append(f"  called but not traced, so a race inside is not explored (add with --trace-module): "
                     f"{', '.join(report.reached)}")
    return lines


def _progress(p: Progress) -> None:
    levels = " ".join(f"{b}p:{n}" for b, n in p.per_bound.items() if n)
    end = "\r" if sys.stderr.isatty() else "\n"
    print(f"  ... {p.executions:,} executions, {p.distinct_states} distinct end states, {p.seconds:.0f}s  {levels}",
          file=sys.stderr, end=end, flush=True)


def limits_of(args: argparse.Namespace) -> SearchLimits:
    return SearchLimits(max_executions=args.max_executions, time_limit=args.time_limit,
                        run=RunLimits(max_points=args.max_steps, max_ops=args.max_bytecodes,
                                      stall_seconds=args.stall_seconds))


def run_explore(args: argparse.Namespace) -> int:
    gil.check_supported()
    scenario = load(args.target, args.trace_module)
    report = explore(scenario, SwitchMode(args.switch), args.bound, args.strategy, args.seed, args.runs,
                     args.depth, args.count_all, not args.no_shrink, limits_of(args),
                     None if args.quiet else _progress)
    print("\n".join(summary(report, shrunk=not args.no_shrink)))
    if report.finding is None:
        if args.save:
            print(f"nothing saved to {args.save}: no losing schedule was found", file=sys.stderr)
        return int(report.verdict.exit_code)
    print()
    print(narrative.render(report.finding.execution, scenario.names))
    if args.save:
        save(args.save, report.finding.schedule)
        print(f"\nschedule saved to {args.save}; replay: isolab race explore --replay {args.save}")
    return int(ExitCode.BUG)


def run_replay(target: str | None, path: Path, times: int, limits: SearchLimits, trace_modules: Sequence[str] = ()) -> int:
    gil.check_supported()
    schedule = load_schedule(path)
    scenario = load(target or schedule.target or schedule.scenario, (*schedule.trace_modules, *trace_modules))
    result = replay(scenario, schedule, times, limits.run)
    print(f"replay {path} on {absolute_target(scenario.target or scenario.name)} (switch={schedule.switch}): "
          f"reproduced {result.reproduced} of {result.runs}  [saved outcome: {schedule.outcome}]")
    if result.changed_sources:
        print(f"  source changed since the schedule was saved: {', '.join(result.changed_sources)}")
    if result.divergence:
        print(f"  first divergence: {result.divergence}")
    code = result.exit_code
    if code == ExitCode.INCONCLUSIVE and result.divergence and not result.inconclusive:
        print(f"  the schedule no longer applies, so this replay shows nothing (a fix and a stale schedule look "
              f"alike): search again with `isolab race explore {absolute_target(scenario.target or scenario.name)}`")
    print()
    print(narrative.render(result.last, scenario.names))
    return int(code)
