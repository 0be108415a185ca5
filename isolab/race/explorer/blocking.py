"""Owns the one path every modelled primitive's operation takes, and the base they share: a
sync point before the operation (a choice point where the switch model allows one, and the
operation's footprint), `after_sync` after it on every path (a non-blocking acquire that fails, a
timeout, an exception), and `block` in between when it has to wait; the primitive's stable name;
and the guard that says when a thread parked before the operation could proceed. Does not know
any particular primitive (primitives.py) nor how a thread is chosen (it calls a `types.Scheduler`).

Queries (`Event.is_set`, `Lock.locked`) take the same path as reads: they are what another
thread's set or acquire does not commute with. From outside a managed thread (a scenario's check,
a narrative's watch) they just read.

Outside every thread body (setup, check, watch) any operation runs unscheduled, as the real
primitive would with nobody else about, held by OUTSIDE: setup may fill a queue or set an event,
check may take a lock. Such a caller cannot wait: what it would wait for (a lock a thread still
holds, an event nobody sets) is a RuntimeError that names it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from isolab.race.explorer.types import Abort, Scheduler

Guard = tuple[Callable[[], bool], Callable[[], str]]


class _Outside:
    """Who holds a primitive that setup, check or watch took: no thread, never scheduled."""

    name = "setup/check"
    index = -1

    def __repr__(self) -> str:
        return "OUTSIDE"


OUTSIDE: Any = _Outside()


class OutsideWait(RuntimeError):
    """Setup, check or watch would wait for what only a thread can let go (a lock a thread kept)."""


def operation(op: str, query: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """Wraps a primitive method: a sync point named `<primitive>.<op>` before, after_sync after,
    whatever way the method returns. The method gets the calling task after `self`. A `query`
    only reads the primitive, and outside a managed thread (or in a watch) runs unscheduled."""

    def wrap(method: Callable[..., Any]) -> Any:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def run(self: Primitive, *args: Any, **kwargs: Any) -> Any:
            rt = self.rt
            if query and (rt.silent or rt.me() is None):
                return method(self, None, *args, **kwargs)
            if rt.silent or rt.me() is None:  # setup, check or watch: nobody to schedule, nothing to wait for
                return method(self, OUTSIDE, *args, **kwargs)
            if rt.aborted:
                raise Abort
            # only a call that would wait with no timeout may be parked by the guard: a
            # non-blocking or timed one proceeds (it fails, or waits in virtual time)
            plain = not (args or kwargs) or self.waits_forever(signature.bind(self, None, *args, **kwargs))
            task = rt.sync_point(f"{self.name}.{op}", self.c_level, guard=self.guard(op) if plain else None,
                                 read=query)
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
        """For an operation called with its defaults (acquire(), wait(), `with`) that would only
        block: (when it can proceed, what it waits for). A thread parked before such an operation
        is not runnable until then: running it would change nothing but its own state, from
        running to blocked."""
        return None

    def timed(self, timeout: float | None) -> bool:
        """Whether a wait with this timeout ends by itself (threading's Condition, Event, Semaphore)."""
        return timeout is not None

    def waits_forever(self, call: inspect.BoundArguments) -> bool:
        """Whether this call, if it has to wait, waits until another thread lets it go."""
        call.apply_defaults()
        return bool(call.arguments.get("blocking", True)) and not self.timed(call.arguments.get("timeout"))

    def wait_until(self, task: Any, ready: Callable[[], bool], why: Callable[[], str], timed: bool) -> bool:
        if task is OUTSIDE:
            if ready() or timed:
                return ready()
            raise OutsideWait(f"{why()}, outside the threads (setup, check or watch), where nothing can "
                              "let it go")
        return self.rt.block(task, ready, why, timed)

    def current(self) -> Any:
        """The task calling, or OUTSIDE (setup, check, watch)."""
        me = self.rt.me()
        return OUTSIDE if me is None or self.rt.silent else me  # (a watch runs silent inside a thread)
