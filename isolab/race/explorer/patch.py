"""Owns the patch that puts the modelled primitives in place for one execution: threading's
factories and `time.sleep` for ones that model inside the runtime, `Thread.start` and
`ThreadPoolExecutor.submit` for ones that end the execution as unsupported, and the real
primitives a traced module made before exploring (module globals, class attributes) for fresh
models, put back afterwards. Does not model anything itself (primitives.py does)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, SupportsIndex

from isolab.race.explorer.blocking import Primitive
from isolab.race.explorer.primitives import ModelCondition, ModelEvent, ModelLock, ModelRLock, ModelSemaphore
from isolab.race.explorer.types import Scheduler

REAL: dict[str, Any] = {
    "Lock": threading.Lock,
    "RLock": threading.RLock,
    "Condition": threading.Condition,
    "Event": threading.Event,
    "Semaphore": threading.Semaphore,
    "BoundedSemaphore": threading.BoundedSemaphore,
}
_REAL_LOCK = type(threading.Lock())
_REAL_RLOCK = type(threading.RLock())
_REAL_START = threading.Thread.start
_REAL_SUBMIT = ThreadPoolExecutor.submit


def _model_for(rt: Scheduler, obj: object) -> Primitive | None:
    """A fresh model standing in for a real primitive the target made before exploring."""
    if isinstance(obj, _REAL_RLOCK):
        return ModelRLock(rt)
    if isinstance(obj, _REAL_LOCK):
        return ModelLock(rt)
    if isinstance(obj, REAL["Condition"]):
        return ModelCondition(rt)
    if isinstance(obj, REAL["Semaphore"]):
        bound = getattr(obj, "_initial_value", None) if isinstance(obj, REAL["BoundedSemaphore"]) else None
        return ModelSemaphore(rt, getattr(obj, "_value", 1), bound)
    if isinstance(obj, REAL["Event"]):
        return ModelEvent(rt)
    return None


def _swaps(rt: Scheduler, module_names: tuple[str, ...], fakes: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """(holder, attribute, replacement) for each real primitive or factory a traced module holds
    in its globals or in the class attributes of classes it defines."""
    out: list[tuple[Any, str, Any]] = []
    factories = {id(f): name for name, f in REAL.items()}
    for module_name in module_names:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in factories:
                out.append((module, attr, fakes[factories[id(value)]]))
            elif (model := _model_for(rt, value)) is not None:
                model.fixed_name = f"{module_name.rsplit('.', 1)[-1]}.{attr}"
                out.append((module, attr, model))
            elif isinstance(value, type) and value.__module__ == module_name:
                for cattr, cvalue in list(vars(value).items()):
                    if (model := _model_for(rt, cvalue)) is not None:
                        model.fixed_name = f"{value.__name__}.{cattr}"
                        out.append((value, cattr, model))
    return out


def _factories(rt: Scheduler) -> dict[str, Callable[..., Any]]:
    """threading's primitive factories: a model for setup and managed threads, the real one else."""

    def Lock() -> Any:
        return ModelLock(rt) if rt.managed() else REAL["Lock"]()

    def RLock() -> Any:
        return ModelRLock(rt) if rt.managed() else REAL["RLock"]()

    def Condition(lock: Any = None) -> Any:
        return ModelCondition(rt, lock) if rt.managed() else REAL["Condition"](lock)

    def Event() -> Any:
        return ModelEvent(rt) if rt.managed() else REAL["Event"]()

    def Semaphore(value: int = 1) -> Any:
        return ModelSemaphore(rt, value) if rt.managed() else REAL["Semaphore"](value)

    def BoundedSemaphore(value: int = 1) -> Any:
        return ModelSemaphore(rt, value, bound=value) if rt.managed() else REAL["BoundedSemaphore"](value)

    return {"Lock": Lock, "RLock": RLock, "Condition": Condition, "Event": Event,
            "Semaphore": Semaphore, "BoundedSemaphore": BoundedSemaphore}


def _sleep(rt: Scheduler, real_sleep: Callable[[Any], None]) -> Callable[[float | SupportsIndex], None]:
    """time.sleep: in a managed thread, virtual time (it only lets the others run)."""

    def sleep(seconds: float | SupportsIndex) -> None:
        if rt.me() is None:
            return real_sleep(seconds)
        task = rt.sync_point("sleep", False, yielding=True)  # virtual time: a sleep only lets others run
        rt.after_sync(task)

    return sleep


def _unsupported_starts(rt: Scheduler) -> tuple[Callable[..., None], Callable[..., Any]]:
    """Thread.start and ThreadPoolExecutor.submit: inside a body they end the execution as unsupported."""

    def start(thread: threading.Thread) -> None:
        if rt.me() is not None:
            rt.unsupported(f"starts a thread ({thread.name}); threads started inside a body (Thread.start, "
                           "an executor's submit) are not modelled: list them in Scenario.threads")
        elif rt.managed():  # setup: the thread's start-up waits on a modelled Event nobody schedules
            raise RuntimeError(f"starts a thread ({thread.name}); threads started in setup are not modelled: "
                               "list their work in Scenario.threads")
        _REAL_START(thread)

    def submit(executor: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if rt.me() is not None:  # before submit takes its module-level (real) lock
            rt.unsupported("submits to a thread pool; an executor's worker threads are not modelled: "
                           "list the work as Scenario.threads")
        return _REAL_SUBMIT(executor, fn, *args, **kwargs)

    return start, submit


@contextmanager
def modelled(rt: Scheduler, module_names: tuple[str, ...] = ()) -> Iterator[None]:
    """Swaps threading's factories (and time.sleep, Thread.start) for ones that model inside `rt`,
    and the real primitives held by `module_names` for fresh models."""
    real_sleep = time.sleep
    fakes = _factories(rt)
    start, submit = _unsupported_starts(rt)
    swaps = _swaps(rt, module_names, fakes)
    saved = [(holder, attr, vars(holder)[attr]) for holder, attr, _ in swaps]
    for name, fake in fakes.items():
        setattr(threading, name, fake)
    time.sleep = _sleep(rt, real_sleep)
    threading.Thread.start = start  # type: ignore[method-assign]
    ThreadPoolExecutor.submit = submit  # type: ignore[method-assign]
    for holder, attr, replacement in swaps:
        setattr(holder, attr, replacement)
    try:
        yield
    finally:
        for holder, attr, original in saved:
            setattr(holder, attr, original)
        for name, original in REAL.items():
            setattr(threading, name, original)
        time.sleep = real_sleep
        threading.Thread.start = _REAL_START  # type: ignore[method-assign]
        ThreadPoolExecutor.submit = _REAL_SUBMIT  # type: ignore[method-assign]
