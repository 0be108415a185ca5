"""Owns the modelled synchronisation primitives and the patch that puts them in place.

Inside an explored execution, `threading.Lock()` & co. called from setup or a managed thread
return a model whose blocking is known to the scheduler: a thread waiting for a lock is not
runnable, and when no thread is runnable the execution is a deadlock. Anyone else (the
explorer's own thread, pytest) still gets the real primitive. `queue.Queue` is covered because
it builds its mutex and conditions from `threading.Lock` and `threading.Condition`.

Not modelled: primitives created before the patch, `_thread` locks, real I/O, timeouts in
`queue.Queue.get(timeout=...)` (it measures real time). Timeouts elsewhere use virtual time: a
timed wait ends only when no thread can run otherwise.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, SupportsIndex

if TYPE_CHECKING:
    from isolab.race.explorer.runtime import Runtime, Task

_ids = itertools.count(1)


class ModelLock:
    def __init__(self, rt: Runtime, kind: str = "Lock") -> None:
        self.rt = rt
        self.name = f"{kind}#{next(_ids)}"
        self.owner: Task | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        task = self.rt.sync_point(f"{self.name}.acquire")
        if self.owner is not None:
            if not blocking:
                self.rt.after_sync(task)
                return False
            holder = self.owner.name
            if not self.rt.block(task, lambda: self.owner is None, f"waits for {self.name} held by {holder}", timeout >= 0):
                return False
        self.owner = task
        self.rt.after_sync(task)
        return True

    def release(self) -> None:
        if self.owner is None:
            raise RuntimeError("release unlocked lock")
        if not self.rt.aborted:
            self.rt.sync_point(f"{self.name}.release")
        self.owner = None

    def locked(self) -> bool:
        return self.owner is not None

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    # Condition support: a plain lock is released and re-taken whole.
    def _release_save(self) -> Any:
        self.owner = None
        return None

    def _acquire_restore(self, saved: Any) -> None:
        self.acquire()

    def _is_owned(self) -> bool:
        return self.owner is not None and self.owner is self.rt.me()


class ModelRLock(ModelLock):
    def __init__(self, rt: Runtime) -> None:
        super().__init__(rt, "RLock")
        self.count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self.rt.me()
        if self.owner is me and me is not None:
            self.count += 1
            return True
        if not super().acquire(blocking, timeout):
            return False
        self.count = 1
        return True

    __enter__ = acquire

    def release(self) -> None:
        if self.owner is not self.rt.me():
            raise RuntimeError("cannot release un-acquired lock")
        self.count -= 1
        if self.count == 0:
            super().release()

    def _release_save(self) -> Any:
        saved, self.count, self.owner = self.count, 0, None
        return saved

    def _acquire_restore(self, saved: Any) -> None:
        ModelLock.acquire(self)
        self.count = saved


class ModelCondition:
    def __init__(self, rt: Runtime, lock: ModelLock | None = None) -> None:
        self.rt = rt
        self.lock = lock if lock is not None else ModelRLock(rt)
        self.name = f"Condition#{next(_ids)}"
        self.waiters: list[list[bool]] = []
        self.acquire, self.release = self.lock.acquire, self.lock.release

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if not self.lock._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        task = self.rt.sync_point(f"{self.name}.wait")
        waiter = [False]
        self.waiters.append(waiter)
        saved = self.lock._release_save()
        try:
            notified = self.rt.block(task, lambda: waiter[0], f"waits on {self.name} (not notified)", timeout is not None)
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)
            if not self.rt.aborted:
                self.lock._acquire_restore(saved)
        return notified

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        result = predicate()
        while not result:
            if not self.wait(timeout) and timeout is not None:
                return predicate()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        if not self.lock._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        task = self.rt.sync_point(f"{self.name}.notify")
        for waiter in self.waiters[:n]:
            waiter[0] = True
        del self.waiters[:n]
        self.rt.after_sync(task)

    def notify_all(self) -> None:
        self.notify(len(self.waiters))

    notifyAll = notify_all


class ModelEvent:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.name = f"Event#{next(_ids)}"
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        task = self.rt.sync_point(f"{self.name}.set")
        self.flag = True
        self.rt.after_sync(task)

    def clear(self) -> None:
        task = self.rt.sync_point(f"{self.name}.clear")
        self.flag = False
        self.rt.after_sync(task)

    def wait(self, timeout: float | None = None) -> bool:
        task = self.rt.sync_point(f"{self.name}.wait")
        self.rt.block(task, lambda: self.flag, f"waits for {self.name}", timeout is not None)
        return self.flag


class ModelSemaphore:
    def __init__(self, rt: Runtime, value: int = 1, bound: int | None = None) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self.rt = rt
        self.name = f"{'Bounded' if bound is not None else ''}Semaphore#{next(_ids)}"
        self.value = value
        self.bound = bound

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        task = self.rt.sync_point(f"{self.name}.acquire")
        if self.value == 0:
            if not blocking:
                return False
            if not self.rt.block(task, lambda: self.value > 0, f"waits for {self.name} (value 0)", timeout is not None):
                return False
        self.value -= 1
        self.rt.after_sync(task)
        return True

    __enter__ = acquire

    def release(self, n: int = 1) -> None:
        task = self.rt.sync_point(f"{self.name}.release")
        if self.bound is not None and self.value + n > self.bound:
            raise ValueError("Semaphore released too many times")
        self.value += n
        self.rt.after_sync(task)

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def modelled(rt: Runtime) -> Iterator[None]:
    """Swaps threading's factories (and time.sleep) for ones that model inside `rt`."""
    real: dict[str, Any] = {
        "Lock": threading.Lock,
        "RLock": threading.RLock,
        "Condition": threading.Condition,
        "Event": threading.Event,
        "Semaphore": threading.Semaphore,
        "BoundedSemaphore": threading.BoundedSemaphore,
    }
    real_sleep = time.sleep

    def Lock() -> Any:
        return ModelLock(rt) if rt.managed() else real["Lock"]()

    def RLock() -> Any:
        return ModelRLock(rt) if rt.managed() else real["RLock"]()

    def Condition(lock: Any = None) -> Any:
        return ModelCondition(rt, lock) if rt.managed() else real["Condition"](lock)

    def Event() -> Any:
        return ModelEvent(rt) if rt.managed() else real["Event"]()

    def Semaphore(value: int = 1) -> Any:
        return ModelSemaphore(rt, value) if rt.managed() else real["Semaphore"](value)

    def BoundedSemaphore(value: int = 1) -> Any:
        return ModelSemaphore(rt, value, bound=value) if rt.managed() else real["BoundedSemaphore"](value)

    def sleep(seconds: float | SupportsIndex) -> None:
        if rt.me() is None:
            return real_sleep(seconds)
        task = rt.sync_point("sleep", yielding=True)  # virtual time: a sleep only lets others run
        rt.after_sync(task)

    fakes = {"Lock": Lock, "RLock": RLock, "Condition": Condition, "Event": Event,
             "Semaphore": Semaphore, "BoundedSemaphore": BoundedSemaphore}
    for name, fake in fakes.items():
        setattr(threading, name, fake)
    time.sleep = sleep
    try:
        yield
    finally:
        for name, original in real.items():
            setattr(threading, name, original)
        time.sleep = real_sleep
