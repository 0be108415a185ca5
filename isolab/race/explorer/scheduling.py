"""Owns who runs next and how the baton passes: the decision at each choice point (who is
enabled, the chooser's pick, deadlock and the choice-point limit), parking a thread before an
operation that would block, and the `types.Scheduler` interface the modelled primitives call
(`sync_point`, `block`, `after_sync`). Does not start threads (runtime.py), turn bytecode into
choice points (tracer.py) or search (search.py).

It is the class between tracer.Tracer and runtime.Runtime: one object, so the hot hooks reach
`choice` without indirection.
"""

from __future__ import annotations

import _thread
import sys
from collections.abc import Callable
from typing import Any

from isolab.race.explorer.task import RunLimits, Task
from isolab.race.explorer.tracer import Tracer
from isolab.race.explorer.types import (
    REDUNDANT,
    Abort,
    ChoicePoint,
    Chooser,
    Outcome,
    PendingPoint,
    short_path,
)


class Scheduling(Tracer):
    """The scheduler half of runtime.Runtime. Exactly one managed thread holds the baton at any
    time; the attributes below are owned by Runtime."""

    chooser: Chooser
    limits: RunLimits
    tasks: list[Task]
    by_ident: dict[int, Task]
    points: list[ChoicePoint]
    in_setup: bool
    outcome: Outcome | None
    message: str | None
    holder: Task | None
    handback: Any
    num_arrivals: int

    # --- who is calling ----------------------------------------------------------------------
    def me(self) -> Task | None:
        return self.by_ident.get(_thread.get_ident())

    def managed(self) -> bool:
        return self.in_setup or _thread.get_ident() in self.by_ident

    def unsupported(self, why: str) -> None:
        task = self.me()
        frame = self._user_frame()
        where = f" at {short_path(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else ""
        self._end(Outcome.UNSUPPORTED, f"{task.name if task else 'setup'}{where} {why}")
        raise Abort

    # --- choice points --------------------------------------------------------------------------
    def _decide(self, task: Task | None, location: str, occurrence: int, what: str, gil_ok: bool, forced: bool) -> int:
        """Picks who runs next; raises Abort (after ending the execution) when nobody can."""
        enabled = [t.index for t in self.tasks if t.enabled()]
        timed_out = False
        if not enabled:  # virtual time jumps to the earliest timeout: timed waiters may run
            enabled = [t.index for t in self.tasks if not t.finished and t.timed]
            timed_out = True
        if not enabled:
            blocked = "; ".join(f"{t.name} {t.blocked_on()}" for t in self.tasks if not t.finished)
            self._end(Outcome.DEADLOCK, blocked)
            raise Abort
        current = task.index if task is not None else None
        current_enabled = (not forced) and current in enabled and not timed_out
        if len(enabled) == 1:
            chosen = enabled[0]
        else:
            if len(self.points) >= self.limits.max_points:
                spinner = max(self.tasks, key=lambda t: t.arrivals)
                self._end(Outcome.NO_PROGRESS,
                          f"{spinner.name} makes no progress: {self.limits.max_points:,} choice points in one "
                          f"execution, the last at {location} (a loop that never ends, or a spin-wait: that "
                          "needs a fair scheduler, which the explorer does not assume; wait on an Event or "
                          "Condition instead)")
                raise Abort
            point = PendingPoint(index=len(self.points), current=current, enabled=tuple(enabled), location=location,
                                 occurrence=occurrence, what=what, gil_ok=gil_ok, current_enabled=current_enabled,
                                 touched=frozenset(self.touched))
            self.touched.clear()
            chosen = self.chooser.choose(point)
            if chosen == REDUNDANT and self.outcome is None:
                self._end(Outcome.REDUNDANT, None)
                raise Abort
            if chosen not in enabled or self.outcome is not None:
                self._end(self.outcome or Outcome.DIVERGED,
                          self.message or f"chooser picked a thread that cannot run: {chosen}")
                raise Abort
            self.points.append(ChoicePoint(point, chosen))
        if timed_out:
            self.tasks[chosen].timed_out = True
        return chosen

    def _switch_to(self, task: Task, chosen: int, why: str) -> None:
        if chosen == task.index:
            return
        self._note_switch(task, why)
        self.holder = self.tasks[chosen]
        self.tasks[chosen].baton.release()
        task.baton.acquire()
        if self.aborted:
            raise Abort

    def choice(self, task: Task, frame: Any, what: str, gil_ok: bool, yielding: bool = False,
               guard: Any = None) -> None:
        """The running task reached a choice point in `frame`."""
        location = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        task.occurrences[location] += 1
        task.arrivals += 1
        self.num_arrivals += 1
        task.last_choice_ops = self.num_ops
        task.guard = guard
        if not task.primed:  # the first shared operation: park until the first decision picks us
            task.primed = True
            self._note_switch(task, "reached its first shared operation; waits for the first decision")
            self.handback.release()
            task.baton.acquire()
            task.guard = None
            if self.aborted:
                raise Abort
            if self.record:
                self._note_line(task, frame, resumed=True)
            return
        try:
            chosen = self._decide(task, location, task.occurrences[location], what, gil_ok, forced=yielding)
            preempted = chosen != task.index
            self._switch_to(task, chosen, f"{'yielded' if yielding else 'preempted'} before {what}")
        finally:
            task.guard = None
        if preempted:
            task.permitted = task.gil_permitted = False
            if self.record:
                self._note_line(task, frame, resumed=True)

    def sync_point(self, what: str, c_level: bool, yielding: bool = False, guard: Any = None,
                   read: bool = False) -> Task:
        """Called by a modelled primitive before its operation (`what`: "<name>.<op>"; `read`: it
        only reads the primitive). Entering a Python-level primitive (c_level False) is a switch
        point; a C one (Lock) is not, unless it has to block."""
        task = self.me()
        assert task is not None
        if self.aborted:
            raise Abort
        if not c_level and task.last_choice_ops != self.num_ops:
            # entering Python-level primitive code is a switch point, unless the call itself
            # was just a choice point (nothing ran in between: a second choice would be a twin)
            task.permitted = task.gil_permitted = True
        if not yielding:
            self.touched.add(("r" if read else "w", "prim", what.rpartition(".")[0]))
        if task.permitted or yielding:
            gil_ok = task.gil_permitted or yielding
            task.permitted = task.gil_permitted = False
            frame = self._user_frame()
            self.choice(task, frame, what, gil_ok, yielding, guard)
        return task

    def after_sync(self, task: Task, c_level: bool = False) -> None:
        """After a primitive's operation, on every path. Leaving Python-level primitive code
        (Condition, Event, Semaphore) passes a switch point (CPython 3.11 checks the eval breaker
        after the C call inside it); leaving a C lock's acquire or release does not. Unlike at
        sync_point, a choice taken there is no reason to skip this one: the operation ran in
        between, so a switch after it is a different schedule."""
        if not c_level:
            task.permitted = task.gil_permitted = True

    def block(self, task: Task, ready: Callable[[], bool], waiting_for: Callable[[], str], timed: bool = False) -> bool:
        """Parks `task` until ready() holds; False if virtual time ran out first (timed only).
        Blocking releases the GIL: the thread that runs next is no preemption."""
        if ready():
            return True
        task.waiting, task.waiting_for, task.timed, task.timed_out = ready, waiting_for, timed, False
        try:
            frame = self._user_frame()
            location = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
            while not ready():
                if task.timed_out:
                    return False
                task.occurrences[location] += 1
                chosen = self._decide(task, location, task.occurrences[location], "blocked: " + waiting_for(), True,
                                      forced=True)
                if chosen == task.index and task.timed_out:
                    return False
                self._switch_to(task, chosen, "blocked: " + waiting_for())
            return True
        finally:
            task.waiting, task.waiting_for, task.timed = None, None, False

    def _user_frame(self) -> Any:
        frame: Any = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename not in self.targets:
            frame = frame.f_back
        return frame if frame is not None else sys._getframe(1)
