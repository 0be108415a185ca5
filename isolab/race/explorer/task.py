"""Owns the per-thread record of one execution (`Task`: its baton, what it waits for, its tracer
state) and the per-execution limits (`RunLimits`); does not know how a thread is chosen, traced
or started (scheduling.py, tracer.py, runtime.py)."""

from __future__ import annotations

import _thread
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
