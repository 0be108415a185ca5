"""Owns the modelled synchronisation primitives (Lock, RLock, Condition, Event, Semaphore), each on
the one blocking base (blocking.py); does not know how they are put in place (patch.py) nor how
a thread is chosen (it calls a `types.Scheduler`).

Inside an explored execution, `threading.Lock()` & co. called from setup or a managed thread
return a model whose blocking is known to the scheduler: a thread waiting for a lock is not
runnable, and when no thread is runnable the execution is a deadlock. Anyone else (the
explorer's own thread, pytest) still gets the real primitive. `queue.Queue` is covered because
it builds its mutex and conditions from `threading.Lock` and `threading.Condition`. Primitives
the target made before exploring (a module-level or class-level `_lock = threading.Lock()`, a
`from threading import Lock`) are swapped for fresh models for each execution and put back after.

Every operation, queries included (`Event.is_set`, `Lock.locked`), goes through
`blocking.operation`. `c_level` says whether the real primitive is C code (Lock, RLock: entering
it is no GIL switch point) or Python code in threading.py (Condition, Event, Semaphore: it is).

Not modelled: `_thread` locks, `queue.SimpleQueue`, real I/O, timeouts in
`queue.Queue.get(timeout=...)` (it measures real time), threads started inside a body (the
execution ends as unsupported). Timeouts elsewhere use virtual time: a timed wait ends only when
no thread can run otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from isolab.race.explorer.blocking import Guard, Primitive, operation
from isolab.race.explorer.types import Scheduler


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

    def timed(self, timeout: float | None) -> bool:
        return timeout is not None and timeout >= 0  # a C lock's "no timeout" is -1

    def _take(self, task: Any, blocking: bool, timeout: float | None) -> bool:
        if self.owner is not None:
            if not blocking:
                return False
            holder = self.owner
            if not self.wait_until(task, lambda: self.owner is None,
                                   lambda: f"waits for {self.name} held by {holder.name}", self.timed(timeout)):
                return False
        self.owner = task
        return True

    @operation("release")
    def release(self, task: Any) -> None:
        if self.owner is None:
            raise RuntimeError("release unlocked lock")
        self.owner = None

    @operation("locked", query=True)
    def locked(self, task: Any) -> bool:
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
        self._take(self.current(), True, None)

    def _is_owned(self) -> bool:
        return self.owner is not None and self.owner is self.current()


class ModelRLock(ModelLock):
    kind = "RLock"

    def __init__(self, rt: Scheduler) -> None:
        super().__init__(rt)
        self.count = 0

    def guard(self, op: str) -> Guard | None:
        if op != "acquire":
            return None
        me = self.current()
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
        self._take(self.current(), True, None)
        self.count = saved


class ModelCondition(Primitive):
    kind = "Condition"

    def __init__(self, rt: Scheduler, lock: ModelLock | None = None) -> None:
        super().__init__(rt)
        self.lock = lock if lock is not None else ModelRLock(rt)
        self.waiters: list[list[bool]] = []

    def guard(self, op: str) -> Guard | None:
        return self.lock.guard(op) if op == "acquire" else None

    def waits_forever(self, call: inspect.BoundArguments) -> bool:
        call.apply_defaults()
        if "blocking" in call.arguments:  # acquire: the lock's timeout convention
            return bool(call.arguments["blocking"]) and not self.lock.timed(call.arguments["timeout"])
        return not self.timed(call.arguments.get("timeout"))

    # Condition.__enter__ and __exit__ are Python code wrapping the lock's: entering and leaving
    # them are switch points. (CPython binds acquire and release to the lock's own; acquire is
    # modelled as __enter__, a superset of its switch points.)
    @operation("acquire")
    def acquire(self, task: Any, blocking: bool = True, timeout: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    @operation("release")
    def __exit__(self, task: Any, *exc: object) -> None:
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
                                   self.timed(timeout))
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

    @operation("is_set", query=True)
    def is_set(self, task: Any) -> bool:
        return self.flag

    @operation("set")
    def set(self, task: Any) -> None:
        self.flag = True

    @operation("clear")
    def clear(self, task: Any) -> None:
        self.flag = False

    @operation("wait")
    def wait(self, task: Any, timeout: float | None = None) -> bool:
        self.wait_until(task, lambda: self.flag, lambda: f"waits for {self.name}", self.timed(timeout))
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
                                   self.timed(timeout)):
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
