"""Owns the deterministic interleaving explorer: runs unmodified Python threads one at a time
under a controlled scheduler, searches schedules, and saves/replays the losing one.

    types.py       plain data: SwitchMode, Outcome, ExitCode, choice points, Execution, Scheduler
    task.py        one thread's record in an execution (Task), per-execution limits (RunLimits)
    gil.py         the CPython 3.11 model: local opcodes, GIL switch points, supported versions
    scenario.py    Scenario (setup, threads, check) and TARGET strings
    scope.py       which code is traced, what is left untraced, names traced code only reads
    blocking.py    the one path of every primitive operation: sync point, block, after_sync
    primitives.py  Lock, RLock, Condition, Event, Semaphore (and so queue.Queue) on that base
    patch.py       puts the models in place for one execution (and swaps pre-made primitives)
    footprint.py   what a step touches; when two steps commute (for sleep sets)
    names.py       objects named by the attribute that holds them; where a stuck thread stands
    codeinfo.py    per-code tables: visible opcodes, their footprints, eval-breaker checks
    narrative.py   recording the per-step story of an execution, and telling it
    tracer.py      settrace/setprofile hooks: bytecode -> choice points
    scheduling.py  who runs next at a choice point; parking and blocking; the Scheduler interface
    runtime.py     one execution: real threads, priming, the watchdog, the verdict
    strategies.py  bounded (iterative preemption bounding), PCT, lax replay
    search.py      the one driver over strategies: budgets, progress, the verdict
    shrink.py      delta debugging and sliding preemptions to GIL switch points
    schedule.py    the human-readable schedule file, strict replay and divergence
    api.py         explore(): search, shrink, label, record
"""

from isolab.race.explorer.runtime import run_once
from isolab.race.explorer.scenario import Scenario, load
from isolab.race.explorer.search import (
    SearchLimits,
    SearchResult,
    Verdict,
    bounded_search,
    pct_search,
    search,
)
from isolab.race.explorer.shrink import shrink
from isolab.race.explorer.task import RunLimits
from isolab.race.explorer.types import Execution, ExitCode, Outcome, SwitchMode

__all__ = [
    "Execution",
    "ExitCode",
    "Outcome",
    "RunLimits",
    "Scenario",
    "SearchLimits",
    "SearchResult",
    "SwitchMode",
    "Verdict",
    "bounded_search",
    "load",
    "pct_search",
    "run_once",
    "search",
    "shrink",
]
