"""Owns the deterministic interleaving explorer: runs unmodified Python threads one at a time
under a controlled scheduler, searches schedules, and saves/replays the losing one.

    scenario.py    Scenario (setup, threads, check) and TARGET strings
    runtime.py     one execution: real threads, a baton, the tracer that finds choice points
    primitives.py  Lock, RLock, Condition, Event, Semaphore (and so queue.Queue) modelled
    strategies.py  bounded (iterative preemption bounding), PCT, replay, shrinking
    schedule.py    the human-readable schedule file, strict replay and divergence
    narrative.py   the per-step story of a losing schedule
"""

from isolab.race.explorer.runtime import Execution, SwitchMode, run_once
from isolab.race.explorer.scenario import Scenario, load
from isolab.race.explorer.strategies import SearchResult, bounded_search, pct_search, shrink

__all__ = [
    "Execution",
    "Scenario",
    "SearchResult",
    "SwitchMode",
    "bounded_search",
    "load",
    "pct_search",
    "run_once",
    "shrink",
]
