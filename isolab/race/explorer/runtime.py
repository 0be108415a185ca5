"""Owns one controlled execution of a Scenario: real OS threads that run one at a time, the
baton that passes between them, the watchdog that names a thread stuck outside the model, and
the names of modelled objects (by the attribute that holds them, stable across executions).

It does not decide who runs next (a `Chooser` does), does not search (search.py does) and turns
bytecode into choice points through the Tracer mixin (tracer.py).
"""

from __future__ import annotations

import _thread
import inspect
import os
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from isolab.errors import InvalidRequestError
from isolab.race.explorer.names import find_path, where
from isolab.race.explorer.patch import modelled
from isolab.race.explorer.primitives import Primitive
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.tracer import Tracer
from isolab.race.explorer.types import (
    REDUNDANT,
    Abort,
    ChoicePoint,
    Chooser,
    Execution,
    Outcome,
    PendingPoint,
    SwitchMode,
    short_path,
)


@dataclass(frozen=True)
class RunLimits:
    """Per-execution limits; reaching one makes the execution inconclusive, never a verdict."""

    max_points: int = 10_000  # choice points (a spin-wait reaches this)
    max_ops: int = 2_000_000  # traced bytecodes (a loop over locals that never ends reaches this)
    stall_seconds: float = 3.0  # the running thread executes no traced bytecode for this long

    def __post_init__(self) -> None:
        if self.max_points < 1 or self.max_ops < 1 or self.stall_seconds <= 0:
            raise ValueError("run limits must be positive")


@dataclass(eq=False)
class Task:
    index: int
    name: str
    body: Callable[[Any], Any]
    baton: Any = field(default_factory=_thread.allocate_lock)  # held = may not run
    ident: int | None = None
    finished: bool = False
    waiting: Callable[[], bool] | None = None  # blocked until this returns True
    waiting_for: Callable[[], str] | None = None
    guard: tuple[Callable[[], bool], Callable[[], str]] | None = None  # parked before an op that would block
    timed: bool = False  # the block has a timeout: virtual time may end it
    timed_out: bool = False
    result: Any = None
    error: str | None = None
    last_exception: str | None = None
    # tracer state
    permitted: bool = True  # a switch point passed since the last choice point (in this mode)
    gil_permitted: bool = True  # ... one where CPython 3.11 with the GIL can switch
    pending_frame: Any = None  # the frame whose last opcode checks the eval breaker after it
    jump_frame: Any = None  # the frame whose last opcode was a conditional backward jump
    jump_offset: int = 0
    occurrences: Counter = field(default_factory=Counter)
    arrivals: int = 0
    primed: bool = False  # ran up to its first choice point
    last_choice_ops: int = -1  # Runtime.num_ops at this task's last choice point

    def enabled(self) -> bool:
        if self.finished or (self.waiting is not None and not self.waiting()):
            return False
        return self.guard is None or self.guard[0]()

    def blocked_on(self) -> str:
        if self.waiting_for is not None:
            return self.waiting_for()
        if self.guard is not None:
            return self.guard[1]()
        return "is runnable"


class Runtime(Tracer):
    """Runs one execution. Exactly one managed thread holds the baton at any time."""

    def __init__(self, scenario: Scenario, chooser: Chooser, mode: SwitchMode = SwitchMode.OPCODE,
                 record: bool = False, limits: RunLimits | None = None) -> None:
        self.scenario = scenario
        self.chooser = chooser
        self.mode = mode
        self.record = record
        self.limits = limits or RunLimits()
        self.max_ops = self.limits.max_ops
        self.num_ops = 0
        self.targets = scenario.target_files()
        self.tasks: list[Task] = []
        self.by_ident: dict[int, Task] = {}
        self.points: list[ChoicePoint] = []
        self.in_setup = False
        self.aborted = False
        self.silent = False
        self.outcome: Outcome | None = None
        self.message: str | None = None
        self.done = _thread.allocate_lock()
        self.state: Any = None
        self.steps: list = []
        self.holder: Task | None = None
        self.touched: set[tuple[str, str, str]] = set()
        self.handback = _thread.allocate_lock()  # released by a thread that finished priming
        self.handback.acquire()
        self.num_arrivals = 0
        self._last_progress, self._last_change = -1, time.monotonic()
        self._names: dict[int, str] = {}
        self._ordinals: Counter = Counter()
        self._init_tracer(scenario.code_infos, scenario.readonly_names)

    # --- who is calling ----------------------------------------------------------------------
    def me(self) -> Task | None:
        return self.by_ident.get(_thread.get_ident())

    def managed(self) -> bool:
        return self.in_setup or _thread.get_ident() in self.by_ident

    # --- the execution -----------------------------------------------------------------------
    def run(self) -> Execution:
        with modelled(self, self.scenario.traced_module_names()):
            self.in_setup = True
            try:
                self.state = self.scenario.setup()
            except Exception as exc:
                raise InvalidRequestError(f"{self.scenario.name}: setup raised {type(exc).__name__}: {exc}") from None
            finally:
                self.in_setup = False
            self.tasks = [Task(i, name, body) for i, (name, body) in enumerate(zip(self.scenario.names,
                                                                                  self.scenario.threads, strict=True))]
            coroutine = next((t for t in self.tasks if inspect.iscoroutinefunction(inspect.unwrap(t.body))), None)
            if coroutine is not None:
                self.done.acquire()
                self._end(Outcome.UNSUPPORTED, f"{coroutine.name}'s body is an async def: the explorer runs threads, "
                          "not asyncio tasks (call asyncio.run inside a plain function to explore it as one thread)")
            else:
                self._run_threads()
        results = tuple(t.result for t in self.tasks)
        outcome, message = self.outcome or Outcome.OK, self.message
        if outcome is Outcome.OK:
            outcome, message = self._verdict(results)
        return Execution(self.points, outcome, message, results, self.steps, frozenset(self.touched), self._shared())

    def _run_threads(self) -> None:
        threads = []
        for task in self.tasks:
            task.baton.acquire()
            threads.append(threading.Thread(target=self._thread_main, args=(task,), name=f"race-{task.name}",
                                            daemon=True))
        self.done.acquire()
        for task, t in zip(self.tasks, threads, strict=True):
            _real_start(t)  # returns once the thread runs; it then waits for its baton
            assert t.ident is not None
            task.ident = t.ident
            self.by_ident[t.ident] = task
        if self._prime():
            try:
                first = self._decide(None, "<start>", 1, "start", True, forced=False)
            except Abort:
                first = None
            if first is not None:
                self.holder = self.tasks[first]
                self.tasks[first].baton.release()
        self._watch()
        if self.outcome is not Outcome.OK:
            self.aborted = True
            for task in self.tasks:
                if not task.finished and task.baton.locked():
                    try:
                        task.baton.release()
                    except RuntimeError:
                        pass
        for t in threads:
            t.join(1.0)

    def _prime(self) -> bool:
        """Runs each thread, in turn, up to its first choice point. What a thread does before
        its first visible operation touches only its own locals, so the order is immaterial, and
        afterwards every thread stands at a shared operation (with its guard known) when the first
        decision is taken. False when the execution ended meanwhile (or every thread finished)."""
        for task in self.tasks:
            self.holder = task
            task.baton.release()
            if not self._await(self.handback):
                return False
        if all(t.finished for t in self.tasks):
            self._end(Outcome.OK, None)
            return False
        return True

    def _await(self, lock: Any) -> bool:
        """Waits for `lock` to be released to us; False when the execution ended instead."""
        while not lock.acquire(True, 0.05):
            if self.outcome is not None:
                return False
            if self._stalled():
                return False
        return self.outcome is None

    def _watch(self) -> None:
        """Waits for the end; a running thread that executes no traced bytecode for
        stall_seconds is blocked (or busy) outside the model, and is named."""
        while not self.done.acquire(True, 0.05):
            if self._stalled():
                return

    def _stalled(self) -> bool:
        """True (after ending the execution) when the running thread executed no traced code
        for stall_seconds."""
        now = time.monotonic()
        progress = self.num_ops + len(self.points) + self.num_arrivals
        if progress != self._last_progress:
            self._last_progress, self._last_change = progress, now
            return False
        if now - self._last_change < self.limits.stall_seconds:
            return False
        holder = self.holder
        name = holder.name if holder is not None else "a thread"
        stands = where(holder.ident if holder is not None else None, self.targets)
        self._end(Outcome.BLOCKED_OUTSIDE,
                  f"{name} blocked outside the model {stands}: nothing ran for {self.limits.stall_seconds:g}s "
                  "(a lock made outside the explorer, I/O, a C call that waits, or untraced work)")
        return True

    def _verdict(self, results: tuple[Any, ...]) -> tuple[Outcome, str | None]:
        for task, result in zip(self.tasks, results, strict=True):
            if inspect.iscoroutine(result) or inspect.isawaitable(result):
                if hasattr(result, "close"):
                    result.close()
                return Outcome.UNSUPPORTED, (f"{task.name}'s body returned an awaitable that nobody awaits: "
                                             "the explorer runs threads, not asyncio tasks")
        errors = [f"{t.name} raised {t.error}" for t in self.tasks if t.error]
        try:
            verdict = "; ".join(errors) if errors else self.scenario.check(self.state, results)
        except Exception as exc:
            raise InvalidRequestError(f"{self.scenario.name}: check raised {type(exc).__name__}: {exc}") from None
        return (Outcome.FAILED, verdict) if verdict else (Outcome.OK, None)

    def _thread_main(self, task: Task) -> None:
        task.baton.acquire()  # wait for the first turn
        try:
            if self.aborted:
                return
            trace_call, profile = self.hooks(task)
            sys.settrace(trace_call)
            sys.setprofile(profile)
            try:
                task.result = task.body(self.state)
            finally:
                sys.settrace(None)
                sys.setprofile(None)
        except Abort:
            return
        except Exception as exc:  # the body's own failure is a finding, not a crash
            task.error = f"{type(exc).__name__}: {exc}"
            if os.environ.get("ISOLAB_DEBUG"):
                traceback.print_exc()
        if self.aborted:
            return
        task.finished = True
        self._note_switch(task, f"raised {task.error}; thread done" if task.error else "returns; thread done")
        if not task.primed:  # it finished before its first shared operation
            task.primed = True
            self.handback.release()
            return
        if all(t.finished for t in self.tasks):
            self._end(Outcome.OK, None)
            return
        try:
            nxt = self._decide(task, "<finished>", 1, "finished", True, forced=True)
        except Abort:
            return
        self.holder = self.tasks[nxt]
        self.tasks[nxt].baton.release()

    def _end(self, outcome: Outcome, message: str | None) -> None:
        if self.outcome is None:
            self.outcome, self.message = outcome, message
            self.done.release()

    def unsupported(self, why: str) -> None:
        task = self.me()
        frame = self._user_frame()
        where = f" at {short_path(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else ""
        self._end(Outcome.UNSUPPORTED, f"{task.name if task else 'setup'}{where} {why}")
        raise Abort

    # --- scheduling --------------------------------------------------------------------------
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
            point = PendingPoint(len(self.points), current, tuple(enabled), location, occurrence, what, gil_ok,
                                 current_enabled, frozenset(self.touched))
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

    def sync_point(self, what: str, c_level: bool, yielding: bool = False, guard: Any = None) -> Task:
        """Called by a modelled primitive before its operation. Entering a Python-level primitive
        (c_level False) is a switch point; a C one (Lock) is not, unless it has to block."""
        task = self.me()
        assert task is not None
        if self.aborted:
            raise Abort
        if not c_level and task.last_choice_ops != self.num_ops:
            # entering Python-level primitive code is a switch point, unless the call itself
            # was just a choice point (nothing ran in between: a second choice would be a twin)
            task.permitted = task.gil_permitted = True
        if not yielding:
            self.touched.add(("w", "prim", what.rpartition(".")[0]))
        if task.permitted or yielding:
            gil_ok = task.gil_permitted or yielding
            task.permitted = task.gil_permitted = False
            frame = self._user_frame()
            self.choice(task, frame, what, gil_ok, yielding, guard)
        return task

    def after_sync(self, task: Task, c_level: bool = False) -> None:
        """After a primitive's operation. Leaving Python-level primitive code (Condition, Event)
        passes switch points; leaving a C lock's acquire or release does not."""
        if not c_level and task.last_choice_ops != self.num_ops:
            # entering Python-level primitive code is a switch point, unless the call itself
            # was just a choice point (nothing ran in between: a second choice would be a twin)
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

    # --- names -------------------------------------------------------------------------------
    def name_of(self, obj: object, kind: str) -> str:
        """`s.a` for the lock at attribute `a` of the state the bodies call `s`; `Lock#2` (the
        second Lock this execution created) only when no attribute path reaches it."""
        key = id(obj)
        name = self._names.get(key)
        if name is None:
            name = find_path(self.state, obj, self.scenario.state_name()) or self._ordinal(obj, kind)
            self._names[key] = name
        return name

    def _ordinal(self, obj: object, kind: str) -> str:
        ordinal = getattr(obj, "_ordinal", None)
        if ordinal is None:
            self._ordinals[kind] += 1
            ordinal = self._ordinals[kind]
        return f"{kind}#{ordinal}"

    def created(self, obj: Primitive) -> None:
        """Numbers a primitive in creation order (deterministic per execution)."""
        self._ordinals[obj.kind] += 1
        obj._ordinal = self._ordinals[obj.kind]  # type: ignore[attr-defined]

    # --- narrative ---------------------------------------------------------------------------
    def _shared(self) -> str:
        if self.scenario.watch is None:
            return ""
        self.silent = True  # the watch may live in a traced file: it must not make steps or choices
        try:
            return self.scenario.watch(self.state)
        except Exception as exc:  # a watch that fails must not change the execution
            return f"<{type(exc).__name__}>"
        finally:
            self.silent = False


_real_start = threading.Thread.start


def run_once(scenario: Scenario, chooser: Chooser, mode: SwitchMode = SwitchMode.OPCODE, record: bool = False,
             limits: RunLimits | None = None) -> Execution:
    return Runtime(scenario, chooser, mode, record, limits).run()
