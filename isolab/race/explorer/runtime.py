"""Owns one controlled execution of a Scenario: real OS threads that run one at a time, priming
each to its first shared operation, the watchdog that names a thread stuck outside the model, the
verdict of the execution, and the watched shared value. Does not decide who runs next (a
`Chooser` through scheduling.py), turn bytecode into choice points (tracer.py) or search
(search.py).

One object per execution, built in layers, each class a subclass of the one before (the hooks
are hot, and one object keeps their attribute lookups short):

    narrative.Recorder  <-  tracer.Tracer  <-  scheduling.Scheduling  <-  Runtime
"""

from __future__ import annotations

import _thread
import inspect
import os
import sys
import threading
import time
import traceback
from typing import Any

from isolab.errors import InvalidRequestError
from isolab.race.explorer.blocking import OutsideWait, Primitive
from isolab.race.explorer.names import Namer, where
from isolab.race.explorer.patch import modelled
from isolab.race.explorer.scenario import Scenario
from isolab.race.explorer.scheduling import Scheduling
from isolab.race.explorer.task import RunLimits, Task
from isolab.race.explorer.types import Abort, ChoicePoint, Chooser, Execution, Outcome, SwitchMode

__all__ = ["RunLimits", "Runtime", "run_once"]


class Runtime(Scheduling):
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
        self.reached = scenario.reached_files  # untraced Python code traced code calls (kept across executions)
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
        self._namer = Namer(scenario.state_name)
        self._init_tracer(scenario.code_infos, scenario.readonly_names)

    # --- the execution -----------------------------------------------------------------------
    def run(self) -> Execution:
        with modelled(self, self.scenario.traced_module_names()):
            self.in_setup = True
            try:
                self.state = self.scenario.setup()
            except (Exception, SystemExit) as exc:  # (SystemExit: it ended the tool with exit 0, silently)
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
        return Execution(points=self.points, outcome=outcome, message=message, results=results, steps=self.steps,
                         tail=frozenset(self.touched), final=self._shared())

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
        except SystemExit as exc:
            raise InvalidRequestError(f"{self.scenario.name}: check raised SystemExit: {exc}") from None
        except OutsideWait as exc:  # a lock a thread kept in this schedule: the schedule's finding
            return Outcome.FAILED, f"check {exc}"
        except AssertionError as exc:  # a check written with assert: a failed assert is the finding
            return Outcome.FAILED, f"check's assert failed: {exc}" if str(exc) else "check's assert failed"
        except Exception as exc:
            raise InvalidRequestError(f"{self.scenario.name}: check raised {type(exc).__name__}: {exc}") from None
        if verdict is not None and not isinstance(verdict, str):  # True for "fine" read as a failure ("failed: True")
            raise InvalidRequestError(f"{self.scenario.name}: check returned {verdict!r}: return None when the run "
                                      "is right, else a sentence saying what went wrong", field="check")
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
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # the body's own failure is a finding, not a crash
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

    # --- names (types.Scheduler) ----------------------------------------------------------------
    def name_of(self, obj: object, kind: str) -> str:
        return self._namer.name_of(self.state, obj, kind)

    def created(self, obj: Primitive) -> None:
        self._namer.created(obj)

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
