"""Owns the modelled synchronisation primitives and the patch that puts them in place.

Inside an explored execution, `threading.Lock()` & co. called from setup or a managed thread
return a model whose blocking is known to the scheduler: a thread waiting for a lock is not
runnable, and when no thread is runnable the execution is a deadlock. Anyone else (the
explorer's own thread, pytest) still gets the real primitive. `queue.Queue` is covered because
it builds its mutex and conditions from `threading.Lock` and `threading.Condition`. Primitives
the target made before exploring (a module-level or class-level `_lock = threading.Lock()`, a
`from threading import Lock`) are swapped for fresh models for each execution and put back after.

Every operation goes through `Primitive.operation`: one sync point before, `after_sync` after,
on every path. `c_level` says whether the real primitive is C code (Lock, RLock: entering it is
no GIL switch point) or Python code in threading.py (Condition, Event, Semaphore: it is).

Not modelled: `_thread` locks, `queue.SimpleQueue`, real I/O, timeouts in
`queue.Queue.get(timeout=...)` (it measures real time), threads started inside a body (the
execution ends as unsupported). Timeouts elsewhere use virtual time: a timed wait ends only when
no thread can run otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from isolab.race.explorer.types import Abort, Scheduler

Guard = tuple[Callable[[], bool], Callable[[], str]]


def operation(op: str, yielding: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """Wraps a primitive method: a sync point named `<primitive>.<op>` before, after_sync after."""

    def wrap(method: Callable[..., Any]) -> Any:
        @functools.wraps(method)
        def run(self: Primitive, *args: Any, **kwargs: Any) -> Any:
            rt = self.rt
            if rt.aborted:
                raise Abort
            task = rt.sync_point(f"{self.name}.{op}", self.c_level, yielding, self.guard(op))
            try:
                return method(self, task, *args, **kwargs)
            finally:
                rt.after_sync(task, self.c_level)

        return run

    return wrap


class Primitive:
    """The blocking base: a name stable across executions, and the runtime that schedules it."""

    kind = "Primitive"
    c_level = False

    def __init__(self, rt: Scheduler) -> None:
        self.rt = rt
        self.fixed_name: str | None = None  # set when the holder is known at creation (a module global)
        rt.created(self)

    @property
    def name(self) -> str:
        return self.fixed_name or self.rt.name_of(self, self.kind)

    def guard(self, op: str) -> Guard | None:
        """For an operation that would only block: (when it can proceed, what it waits for). A
        thread parked before such an operation is not runnable until then: running it would
        change nothing but its own state, from running to blocked."""
        return None

    def wait_until(self, task: Any, ready: Callable[[], bool], why: Callable[[], str], timed: bool) -> bool:
        return self.rt.block(task, ready, why, timed)


class ModelLock(Primitive):
    kind = "Lock"
    c_level = True

    def __init__(self, rt: Scheduler) -> None:
        super().__init__(rt)
        self.owner: Any = None

    def guard(self, op: str) -> Guard | None:
        if op != "acquire":
            return None
        return (lambda: self.owner is None), (lambda: f"waits for {self.name} held by {self.owner.name}")

    @operation("acquire")
    def acquire(self, task: Any, blocking: bool = True, timeout: float = -1) -> bool:
        return self._take(task, blocking, timeout)

    def _take(self, task: Any, blocking: bool, timeout: float | None) -> bool:
        if self.owner is not None:
            if not blocking:
                return False
            holder = self.owner
            if not self.wait_until(task, lambda: self.owner is None,
                                   lambda: f"waits for {self.name} held by {holder.name}",
                                   timeout is not None and timeout >= 0):
                return False
        self.owner = task
        return True

    @operation("release")
    def release(self, task: Any) -> None:
        if self.owner is None:
            raise RuntimeError("release unlocked lock")
        self.owner = None

    def locked(self) -> bool:
        return self.owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # Condition support: the lock is released and re-taken whole.
    def _release_save(self) -> Any:
        self.owner = None
        return None

    def _acquire_restore(self, saved: Any) -> None:
        task = self.rt.me()
        self._take(task, True, None)

    def _is_owned(self) -> bool:
        return self.owner is not None and self.owner is self.rt.me()


class ModelRLock(ModelLock):
    kind = "RLock"

    def __init__(self, rt: Scheduler) -> None:
        super().__init__(rt)
        self.count = 0

    def guard(self, op: str) -> Guard | None:
        if op != "acquire":
            return None
        me = self.rt.me()
        return (lambda: self.owner is None or self.owner is me), (lambda: f"waits for {self.name} held by {self.owner.name}")

    @operation("acquire")
    def acquire(self, task: Any, blocking: bool = True, timeout: float = -1) -> bool:
        if self.owner is task:
            self.count += 1
            return True
        if not self._take(task, blocking, timeout):
            return False
        self.count = 1
        return True

    @operation("release")
    def release(self, task: Any) -> None:
        if self.owner is not task:
            raise RuntimeError("cannot release un-acquired lock")
        self.count -= 1
        if self.count == 0:
            self.owner = None

    def _release_save(self) -> Any:
        saved, self.count, self.owner = self.count, 0, None
        return saved

    def _acquire_restore(self, saved: Any) -> None:
        self._take(self.rt.me(), True, None)
        self.count = saved


class ModelCondition(Primitive):
    kind = "Condition"

    def __init__(self, rt: Scheduler, lock: ModelLock | None = None) -> None:
        super().__init__(rt)
        self.lock = lock if lock is not None else ModelRLock(rt)
        self.waiters: list[list[bool]] = []

    def guard(self, op: str) -> Guard | None:
        return self.lock.guard(op) if op == "acquire" else None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        # Condition.__enter__ is Python code: entering it is a switch point
        self.rt.sync_point(f"{self.name}.acquire", False, False, self.lock.guard("acquire"))
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    @operation("wait")
    def wait(self, task: Any, timeout: float | None = None) -> bool:
        if not self.lock._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        waiter = [False]
        self.waiters.append(waiter)
        saved = self.lock._release_save()
        try:
            return self.wait_until(task, lambda: waiter[0], lambda: f"waits on {self.name} (not notified)",
                                   timeout is not None)
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)
            if not self.rt.aborted:
                self.lock._acquire_restore(saved)

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        result = predicate()
        while not result:
            if not self.wait(timeout) and timeout is not None:
                return predicate()
            result = predicate()
        return result

    @operation("notify")
    def notify(self, task: Any, n: int = 1) -> None:
        if not self.lock._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        for waiter in self.waiters[:n]:
            waiter[0] = True
        del self.waiters[:n]

    def notify_all(self) -> None:
        self.notify(len(self.waiters))

    notifyAll = notify_all


class ModelEvent(Primitive):
    kind = "Event"

    def __init__(self, rt: Scheduler) -> None:
        super().__init__(rt)
        self.flag = False

    def guard(self, op: str) -> Guard | None:
        return ((lambda: self.flag), (lambda: f"waits for {self.name}")) if op == "wait" else None

    def is_set(self) -> bool:
        return self.flag

    @operation("set")
    def set(self, task: Any) -> None:
        self.flag = True

    @operation("clear")
    def clear(self, task: Any) -> None:
        self.flag = False

    @operation("wait")
    def wait(self, task: Any, timeout: float | None = None) -> bool:
        self.wait_until(task, lambda: self.flag, lambda: f"waits for {self.name}", timeout is not None)
        return self.flag


class ModelSemaphore(Primitive):
    kind = "Semaphore"

    def __init__(self, rt: Scheduler, value: int = 1, bound: int | None = None) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self.kind = "BoundedSemaphore" if bound is not None else "Semaphore"
        super().__init__(rt)
        self.value = value
        self.bound = bound

    def guard(self, op: str) -> Guard | None:
        return ((lambda: self.value > 0), (lambda: f"waits for {self.name} (value 0)")) if op == "acquire" else None

    @operation("acquire")
    def acquire(self, task: Any, blocking: bool = True, timeout: float | None = None) -> bool:
        if self.value == 0:
            if not blocking:
                return False
            if not self.wait_until(task, lambda: self.value > 0, lambda: f"waits for {self.name} (value 0)",
                                   timeout is not None):
                return False
        self.value -= 1
        return True

    @operation("release")
    def release(self, task: Any, n: int = 1) -> None:
        if self.bound is not None and self.value + n > self.bound:
            raise ValueError("Semaphore released too many times")
        self.value += n

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
