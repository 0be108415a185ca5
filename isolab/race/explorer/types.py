"""Owns the explorer's plain data: switch modes, outcomes, choice points, executions, the
narrative step, and the two small interfaces the parts talk through (`Chooser`, `Scheduler`);
does not know any other explorer module.

It imports nothing from the rest of the explorer, so every other module can import it. Imports
point one way (tests/race/test_layout.py checks there is no cycle):

    types, task, gil, footprint
      <-  blocking, codeinfo, narrative, scope, strategies
      <-  primitives, names, scenario, tracer  <-  patch, scheduling  <-  runtime
      <-  search, shrink, schedule  <-  api  <-  (isolab.race.explorer_cli)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, Protocol


class SwitchMode(StrEnum):
    GIL = "gil"  # only where CPython 3.11 with the GIL can switch threads (gil.py)
    LINE = "line"  # the start of every source line
    OPCODE = "opcode"  # before every bytecode: the stand-in for free-threaded CPython


class Outcome(StrEnum):
    """How one execution ended. Only FAILED and DEADLOCK are bugs; the last four are
    inconclusive: the execution says nothing either way about the code under test."""

    OK = "ok"
    FAILED = "failed"  # the scenario's check (or a thread's exception) says what broke
    DEADLOCK = "deadlock"  # no thread can run and some have not finished
    NO_PROGRESS = "no_progress"  # a thread spins or loops past the step or bytecode limit
    BLOCKED_OUTSIDE = "blocked_outside"  # a thread blocked in a call the model does not know
    UNSUPPORTED = "unsupported"  # a thread started a thread, or a body is a coroutine
    DIVERGED = "diverged"  # a replay's chooser picked a thread that cannot run
    REDUNDANT = "redundant"  # cut short: every way on reorders steps an earlier execution ran

    @property
    def is_bug(self) -> bool:
        return self in (Outcome.FAILED, Outcome.DEADLOCK)

    @property
    def is_inconclusive(self) -> bool:
        return self in (Outcome.NO_PROGRESS, Outcome.BLOCKED_OUTSIDE, Outcome.UNSUPPORTED, Outcome.DIVERGED)


class ExitCode(IntEnum):
    """`isolab race explore` exits like a test runner, with one code per verdict."""

    HOLDS = 0  # no bug within the bound (or the replay did not fail)
    BUG = 1  # a losing schedule was found or replayed
    USAGE = 2  # bad arguments or a target that cannot be loaded (one sentence on stderr)
    INCONCLUSIVE = 3  # a limit was reached or the model cannot run the target (reason named)


class Abort(BaseException):
    """Unwinds a managed thread when its execution ends early (deadlock, limit, failure)."""


@dataclass(frozen=True)
class PendingPoint:
    """What a Chooser sees: the running thread wants to go on; who runs next?"""

    index: int  # how many choice points came before this one in this execution
    current: int | None  # the thread that stands here (None at the start)
    enabled: tuple[int, ...]  # threads that may run now, ascending
    location: str  # "isolab/race/checkers.py:38", "<start>" or "<finished>"
    occurrence: int  # the current thread's arrivals at this location so far, from 1
    what: str  # the operation about to run: "STORE_ATTR input_buffer", "s.a.acquire"
    gil_ok: bool  # CPython 3.11 with the GIL could switch here
    current_enabled: bool  # continuing is possible; choosing another thread is a preemption
    touched: frozenset[tuple[str, str, str]] = frozenset()  # footprint.py tokens since the last choice point

    @property
    def default(self) -> int:
        """No preemption: keep running, else the lowest-numbered enabled thread."""
        return self.current if self.current_enabled and self.current is not None else self.enabled[0]


@dataclass(frozen=True)
class ChoicePoint:
    point: PendingPoint
    chosen: int

    @property
    def preemptive(self) -> bool:
        return self.point.current_enabled and self.chosen != self.point.current


class Chooser(Protocol):
    def choose(self, point: PendingPoint) -> int:
        """The thread to run next, one of point.enabled; or REDUNDANT to cut the execution short."""
        ...


REDUNDANT = -1


@dataclass(frozen=True)
class Step:
    """One narrative line: a thread at a source line, and the shared value as the line starts."""

    thread: int
    location: str
    source: str
    shared: str
    repeats: int = 1  # a loop body that left the shared value alone is folded into one step
    switch: str = ""  # why the baton moved after this step ("preempted before ...", "raised ...")
    resumed: bool = False  # the second half of a line cut by a switch


@dataclass
class Execution:
    points: list[ChoicePoint]
    outcome: Outcome
    message: str | None
    results: tuple[Any, ...]
    steps: list[Step] = field(default_factory=list)  # only when recorded
    tail: frozenset[tuple[str, str, str]] = frozenset()  # footprint tokens after the last choice point
    final: str = ""  # the watched shared value at the end (distinct end states)

    @property
    def failed(self) -> bool:
        return self.outcome.is_bug

    @property
    def preemptions(self) -> int:
        return sum(1 for c in self.points if c.preemptive)

    @property
    def gil_reachable(self) -> bool:
        return all(c.point.gil_ok for c in self.points if c.preemptive)

    @property
    def verdict(self) -> str:
        """The outcome as one comparable string: what a schedule file saves and a replay matches."""
        return f"{self.outcome.value}: {self.message}" if self.message else self.outcome.value


class Scheduler(Protocol):
    """What a modelled primitive needs from the runtime (runtime.Runtime implements it)."""

    aborted: bool
    silent: bool  # a watch is running: what it calls is not part of the execution

    def me(self) -> Any: ...
    def managed(self) -> bool: ...
    def sync_point(self, what: str, c_level: bool, yielding: bool = False, guard: Any = None,
                   read: bool = False) -> Any: ...
    def after_sync(self, task: Any, c_level: bool = False) -> None: ...
    def block(self, task: Any, ready: Callable[[], bool], waiting_for: Callable[[], str], timed: bool = False) -> bool: ...
    def name_of(self, obj: object, kind: str) -> str: ...
    def created(self, obj: Any) -> None: ...
    def unsupported(self, why: str) -> None: ...


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXPLORER_DIR = os.path.dirname(os.path.abspath(__file__))


def short_path(filename: str) -> str:
    absolute = os.path.abspath(filename)
    return os.path.relpath(absolute, ROOT) if absolute.startswith(ROOT + os.sep) else absolute
