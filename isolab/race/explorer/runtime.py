"""Owns one controlled execution of a Scenario: real OS threads that run one at a time, the
baton that passes between them, and the tracer that turns bytecode into choice points.

It does not decide who runs next (a `Chooser` does) and does not search (strategies.py does).

How a choice point arises. A *switch point* is where the switch model lets a thread lose the CPU:
    gil     function entry, after a loop back-edge (JUMP_BACKWARD), after a call, at a blocking
            call: exactly where CPython 3.11 checks its eval breaker or releases the GIL
    line    the start of every source line
    opcode  before every bytecode (a stand-in for free-threaded CPython)
A switch only matters before an operation another thread could observe: a *visible* opcode
(attribute, global, subscript, closure-cell access, calls, comparisons...) or a modelled
lock/condition/event operation. Steps that touch only locals commute with everything, so a
preemption at a switch point is equivalent to one at the next visible operation. Hence:
    choice point = a visible operation reached after at least one switch point since the last.
The seed's `for _ in range(1000): pass` touches only locals and costs no choice points.
"""

from __future__ import annotations

import _thread
import dis
import linecache
import os
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from isolab.race.explorer.scenario import Scenario


class SwitchMode(StrEnum):
    GIL = "gil"
    LINE = "line"
    OPCODE = "opcode"


# Opcodes that read or write only the frame's own locals or stack. FOR_ITER is here so that a
# loop over a local iterator is free; iterating a shared container through a local alias is the
# documented blind spot (the load of the container itself is visible).
LOCAL_OPCODES = frozenset(
    {
        "NOP", "RESUME", "CACHE", "EXTENDED_ARG", "LOAD_FAST", "STORE_FAST", "DELETE_FAST",
        "LOAD_CONST", "POP_TOP", "COPY", "SWAP", "PUSH_NULL", "PRECALL", "KW_NAMES",
        "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "POP_JUMP_FORWARD_IF_FALSE",
        "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_TRUE",
        "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NONE",
        "POP_JUMP_BACKWARD_IF_NOT_NONE", "JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP",
        "FOR_ITER", "GET_ITER", "RETURN_VALUE", "UNARY_NOT", "MAKE_CELL", "COPY_FREE_VARS",
        "POP_EXCEPT", "PUSH_EXC_INFO", "RERAISE", "CHECK_EXC_MATCH",
    }
)
# After these, CPython 3.11 checks the eval breaker before the next instruction.
GIL_CHECKPOINT_OPCODES = frozenset({"JUMP_BACKWARD", "CALL", "CALL_FUNCTION_EX"})


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
    what: str  # the operation about to run: "STORE_ATTR input_buffer", "Lock#1.acquire"
    gil_ok: bool  # CPython 3.11 with the GIL could switch here
    current_enabled: bool  # continuing is possible; choosing another thread is a preemption

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
    def choose(self, point: PendingPoint) -> int: ...


@dataclass(frozen=True)
class Step:
    """One narrative line: a thread at a source line, and the shared value as the line starts."""

    thread: int
    location: str
    source: str
    shared: str
    repeats: int = 1  # a loop body that left the shared value alone is folded into one step
    switch: str = ""  # "preempted", "blocked", "finished" when the baton moved after this step


@dataclass
class Execution:
    points: list[ChoicePoint]
    outcome: str  # "ok" | "failed" | "deadlock" | "step_limit" | "diverged" | "hung"
    message: str | None
    results: tuple[Any, ...]
    steps: list[Step] = field(default_factory=list)  # only when recorded

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "deadlock")

    @property
    def preemptions(self) -> int:
        return sum(1 for c in self.points if c.preemptive)

    @property
    def gil_reachable(self) -> bool:
        return all(c.point.gil_ok for c in self.points if c.preemptive)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def short_path(filename: str) -> str:
    absolute = os.path.abspath(filename)
    return os.path.relpath(absolute, ROOT) if absolute.startswith(ROOT + os.sep) else absolute


@dataclass
class Task:
    index: int
    name: str
    body: Callable[[Any], Any]
    baton: Any = field(default_factory=_thread.allocate_lock)  # held = may not run
    finished: bool = False
    waiting: Callable[[], bool] | None = None  # blocked until this returns True
    waiting_for: str = ""
    timed: bool = False  # the block has a timeout: virtual time may end it
    timed_out: bool = False
    result: Any = None
    error: str | None = None
    # tracer state
    permitted: bool = True  # a switch point passed since the last choice point
    gil_permitted: bool = True
    gil_pending: bool = False  # the last opcode was a GIL checkpoint; the next one may switch
    occurrences: Counter = field(default_factory=Counter)

    def enabled(self) -> bool:
        return not self.finished and (self.waiting is None or self.waiting())


class Runtime:
    """Runs one execution. Exactly one managed thread holds the baton at any time."""

    def __init__(
        self,
        scenario: Scenario,
        chooser: Chooser,
        mode: SwitchMode = SwitchMode.OPCODE,
        record: bool = False,
        max_points: int = 20_000,
        wall_timeout: float = 20.0,
    ) -> None:
        self.scenario = scenario
        self.chooser = chooser
        self.mode = mode
        self.record = record
        self.max_points = max_points
        self.wall_timeout = wall_timeout
        self.targets = scenario.target_files()
        self.tasks: list[Task] = []
        self.by_ident: dict[int, Task] = {}
        self.points: list[ChoicePoint] = []
        self.in_setup = False
        self.aborted = False
        self.outcome: str | None = None
        self.message: str | None = None
        self.done = _thread.allocate_lock()
        self.state: Any = None
        self.steps: list[Step] = []
        self._seen_in_run: dict[int, dict[str, int]] = {}  # thread -> location -> step index
        self._ops_cache: dict[Any, dict[int, tuple[str, str, bool]]] = {}
        self.num_arrivals = 0

    # --- who is calling --------------------------------------------------------------------
    def me(self) -> Task | None:
        return self.by_ident.get(_thread.get_ident())

    def managed(self) -> bool:
        return self.in_setup or _thread.get_ident() in self.by_ident

    # --- the execution ---------------------------------------------------------------------
    def run(self) -> Execution:
        from isolab.race.explorer.primitives import modelled

        with modelled(self):
            self.in_setup = True
            self.controller = _thread.get_ident()
            try:
                self.state = self.scenario.setup()
            finally:
                self.in_setup = False
            names = self.scenario.names
            self.tasks = [Task(i, names[i], body) for i, body in enumerate(self.scenario.threads)]
            threads = []
            for task in self.tasks:
                task.baton.acquire()
                t = threading.Thread(target=self._thread_main, args=(task,), name=f"race-{task.name}", daemon=True)
                threads.append(t)
            self.done.acquire()
            for task, t in zip(self.tasks, threads, strict=True):
                t.start()  # returns once the thread runs; it then waits for its baton
                assert t.ident is not None
                self.by_ident[t.ident] = task
            first = self._decide(None, "<start>", 1, "start", True, forced=False)
            self.tasks[first].baton.release()
            finished = self.done.acquire(True, self.wall_timeout)
            if not finished:
                self._end("hung", f"no progress within {self.wall_timeout}s: a thread blocked outside the model")
            if self.outcome != "ok":
                self.aborted = True
                for task in self.tasks:
                    if not task.finished and task.baton.locked():
                        try:
                            task.baton.release()
                        except RuntimeError:
                            pass
            for t in threads:
                t.join(5.0)
        results = tuple(t.result for t in self.tasks)
        outcome, message = self.outcome or "ok", self.message
        if outcome == "ok":
            errors = [f"{t.name} raised {t.error}" for t in self.tasks if t.error]
            verdict = "; ".join(errors) if errors else self.scenario.check(self.state, results)
            if verdict:
                outcome, message = "failed", verdict
        return Execution(self.points, outcome, message, results, self.steps)

    def _thread_main(self, task: Task) -> None:
        task.baton.acquire()  # wait for the first turn
        try:
            if self.aborted:
                return
            sys.settrace(self._trace_call)
            try:
                task.result = task.body(self.state)
            finally:
                sys.settrace(None)
        except Abort:
            return
        except Exception as exc:  # the body's own failure is a finding, not a crash
            task.error = f"{type(exc).__name__}: {exc}"
            if os.environ.get("ISOLAB_DEBUG"):
                traceback.print_exc()
        if self.aborted:
            return
        task.finished = True
        self._note_switch(task, "finished")
        if all(t.finished for t in self.tasks):
            self._end("ok", None)
            return
        try:
            nxt = self._decide(task, "<finished>", 1, "finished", True, forced=True)
        except Abort:
            return
        self.tasks[nxt].baton.release()

    def _end(self, outcome: str, message: str | None) -> None:
        if self.outcome is None:
            self.outcome, self.message = outcome, message
            self.done.release()

    # --- scheduling ------------------------------------------------------------------------
    def _decide(self, task: Task | None, location: str, occurrence: int, what: str, gil_ok: bool, forced: bool) -> int:
        """Picks who runs next; raises Abort (after ending the execution) when nobody can."""
        enabled = [t.index for t in self.tasks if t.enabled()]
        timed_out = False
        if not enabled:  # virtual time jumps to the earliest timeout: timed waiters may run
            enabled = [t.index for t in self.tasks if not t.finished and t.timed]
            timed_out = True
        if not enabled:
            blocked = "; ".join(f"{t.name} {t.waiting_for}" for t in self.tasks if not t.finished)
            self._end("deadlock", f"deadlock: {blocked}")
            raise Abort
        current = task.index if task is not None else None
        current_enabled = (not forced) and current in enabled and not timed_out
        if len(enabled) == 1:
            chosen = enabled[0]
        else:
            if len(self.points) >= self.max_points:
                self._end("step_limit", f"more than {self.max_points} choice points")
                raise Abort
            point = PendingPoint(
                len(self.points), current, tuple(enabled), location, occurrence, what, gil_ok, current_enabled
            )
            chosen = self.chooser.choose(point)
            if chosen not in enabled or self.outcome is not None:
                self._end(self.outcome or "diverged", self.message or f"chooser picked a thread that cannot run: {chosen}")
                raise Abort
            self.points.append(ChoicePoint(point, chosen))
        if timed_out:
            self.tasks[chosen].timed_out = True
        return chosen

    def _switch_to(self, task: Task, chosen: int, why: str) -> None:
        if chosen == task.index:
            return
        self._note_switch(task, why)
        self.tasks[chosen].baton.release()
        task.baton.acquire()
        if self.aborted:
            raise Abort

    def choice(self, task: Task, frame: Any, what: str, gil_ok: bool, yielding: bool = False) -> None:
        """The running task reached a choice point in `frame`."""
        location = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        task.occurrences[location] += 1
        self.num_arrivals += 1
        chosen = self._decide(task, location, task.occurrences[location], what, gil_ok, forced=yielding)
        preempted = chosen != task.index
        self._switch_to(task, chosen, f"{'yielded' if yielding else 'preempted'} before {what}")
        if preempted:
            task.permitted = task.gil_permitted = False

    def sync_point(self, what: str, yielding: bool = False) -> Task:
        """Called by a modelled primitive before its operation (a blocking call: a switch point
        in every mode). Skipped when the thread has not moved since its last choice point."""
        task = self.me()
        assert task is not None
        if self.aborted:
            raise Abort
        if task.permitted or yielding:
            task.permitted = task.gil_permitted = False
            self.choice(task, self._user_frame(), what, True, yielding)
        return task

    def after_sync(self, task: Task) -> None:
        task.permitted = task.gil_permitted = True

    def block(self, task: Task, ready: Callable[[], bool], waiting_for: str, timed: bool = False) -> bool:
        """Parks `task` until ready() holds; False if virtual time ran out first (timed only)."""
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
                occurrence = task.occurrences[location]
                chosen = self._decide(task, location, occurrence, f"blocked: {waiting_for}", True, forced=True)
                if chosen == task.index and task.timed_out:
                    return False
                self._switch_to(task, chosen, "blocked")
            return True
        finally:
            task.waiting, task.waiting_for, task.timed = None, "", False
            self.after_sync(task)

    def _user_frame(self) -> Any:
        frame: Any = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename not in self.targets:
            frame = frame.f_back
        return frame if frame is not None else sys._getframe(1)

    # --- tracing ---------------------------------------------------------------------------
    def _ops(self, code: Any) -> dict[int, tuple[str, str, bool]]:
        ops = self._ops_cache.get(code)
        if ops is None:
            ops = {
                ins.offset: (ins.opname, ins.argrepr, ins.opname not in LOCAL_OPCODES)
                for ins in dis.get_instructions(code)
            }
            self._ops_cache[code] = ops
        return ops

    def _trace_call(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename not in self.targets:
            return None
        task = self.me()
        if task is None or self.aborted:
            return None
        frame.f_trace_opcodes = True
        task.permitted = task.gil_permitted = True  # function entry (RESUME) is a switch point
        task.gil_pending = False
        return self._trace_local

    def _trace_local(self, frame: Any, event: str, arg: Any) -> Any:
        task = self.by_ident.get(_thread.get_ident())
        if task is None:
            return None
        if self.aborted:
            raise Abort
        if event == "line":
            if self.mode is SwitchMode.LINE:
                task.permitted = True
            if self.record:
                self._note_line(task, frame)
            return self._trace_local
        if event != "opcode":
            return self._trace_local
        opname, argrepr, visible = self._ops(frame.f_code).get(frame.f_lasti, ("?", "", True))
        if task.gil_pending:
            task.gil_permitted = True
            task.gil_pending = False
        if self.mode is SwitchMode.OPCODE:
            task.permitted = True
        elif self.mode is SwitchMode.GIL:
            task.permitted = task.gil_permitted
        if visible and task.permitted:
            gil_ok = task.gil_permitted
            task.permitted = task.gil_permitted = False
            self.choice(task, frame, f"{opname} {argrepr}".strip(), gil_ok)
        if opname in GIL_CHECKPOINT_OPCODES:
            task.gil_pending = True
        return self._trace_local

    # --- narrative -------------------------------------------------------------------------
    def _shared(self) -> str:
        if self.scenario.watch is None:
            return ""
        try:
            return self.scenario.watch(self.state)
        except Exception as exc:  # a watch that fails must not change the execution
            return f"<{type(exc).__name__}>"

    def _note_line(self, task: Task, frame: Any) -> None:
        location = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        shared = self._shared()
        seen = self._seen_in_run.setdefault(task.index, {})
        if location in seen:
            i = seen[location]
            if i < len(self.steps) and self.steps[i].shared == shared and self.steps[i].thread == task.index:
                s = self.steps[i]
                self.steps[i] = Step(s.thread, s.location, s.source, s.shared, s.repeats + 1, s.switch)
                return
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        seen[location] = len(self.steps)
        self.steps.append(Step(task.index, location, source, shared))

    def _note_switch(self, task: Task, why: str) -> None:
        if not self.record:
            return
        self._seen_in_run[task.index] = {}
        for i in range(len(self.steps) - 1, -1, -1):
            if self.steps[i].thread == task.index:
                s = self.steps[i]
                if not s.switch:
                    self.steps[i] = Step(s.thread, s.location, s.source, s.shared, s.repeats, why)
                break


def run_once(scenario: Scenario, chooser: Chooser, mode: SwitchMode = SwitchMode.OPCODE, record: bool = False) -> Execution:
    return Runtime(scenario, chooser, mode, record).run()
