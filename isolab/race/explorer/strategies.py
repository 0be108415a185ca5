"""Owns the search strategies: which schedule to run next, given what the last ones did. Each
strategy hands out one `Chooser` per execution and is told the execution that came of it; the
driver (search.py) runs them all the same way. None of them knows about threads or bytecode.

    bounded   iterative preemption bounding (CHESS): every schedule with 0 preemptions, then 1,
              then 2 ... up to the bound, exhaustive within it; the first failure found therefore
              has the fewest preemptions possible. With sleep sets (Godefroid) it skips schedules
              that only reorder independent steps (footprint.py), kept sound under the bound by
              putting to sleep only a thread whose step was a free continuation (see BoundedStrategy).
    pct       Probabilistic Concurrency Testing: random thread priorities and depth-1 priority
              change points; a bug of depth d is hit with p >= 1/(n k^(d-1)) per run.
    replay    follow a saved schedule step by step (strict, schedule.py) or only its non-default
              decisions (lax, used to shrink).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Protocol

from isolab.race.explorer.footprint import Token, independent
from isolab.race.explorer.types import REDUNDANT, Chooser, Execution, PendingPoint

Sleep = dict[int, frozenset[Token]]  # thread -> the footprint of its next step, already explored


class Strategy(Protocol):
    label: str  # "bounded(2)", "pct(seed=0, depth=2, runs=200)"
    per_bound: dict[int, int]  # executions per preemption count (bounded only)

    def next(self) -> Chooser | None:
        """The chooser for the next execution; None when the strategy has nothing left."""
        ...

    def observe(self, execution: Execution) -> None: ...

    @property
    def exhausted(self) -> bool:
        """Every schedule the strategy covers was run (what lets 'holds' mean 'within the bound')."""
        ...


class PrefixChooser:
    """Follows a list of choices, then never preempts."""

    def __init__(self, prefix: list[int]) -> None:
        self.prefix = prefix

    def choose(self, point: PendingPoint) -> int:
        if point.index < len(self.prefix):
            return self.prefix[point.index]
        return point.default


class SleepChooser:
    """Follows a prefix; from its last choice on, never runs a sleeping thread (one whose next
    step was explored first at an ancestor and commutes with everything run since). When only
    sleeping threads can run, every continuation is a reordering of an explored schedule: the
    execution is cut short as REDUNDANT."""

    def __init__(self, prefix: list[int], entry: Sleep) -> None:
        self.prefix, self.entry = prefix, entry
        self.sleep: Sleep = {}

    def choose(self, point: PendingPoint) -> int:
        last = len(self.prefix) - 1
        if point.index < last:
            return self.prefix[point.index]
        if point.index == last:
            self.sleep = dict(self.entry)
            return self.prefix[last]
        self.sleep = wake(self.sleep, point.touched)
        if point.default not in self.sleep:
            return point.default
        awake = [t for t in point.enabled if t not in self.sleep]
        return awake[0] if awake else REDUNDANT


def wake(sleep: Sleep, touched: frozenset[Token]) -> Sleep:
    """The sleeping threads whose step still commutes with what just ran."""
    return {t: f for t, f in sleep.items() if independent(f, touched)} if sleep else sleep


class BoundedStrategy:
    """A schedule is its list of choices; a child deviates from its parent's default at one
    point past the parent's prefix, so each schedule runs exactly once. Queues per preemption
    count make the order 0, 1, 2 ... preemptions.

    Sleep sets, kept sound under the preemption bound: at a choice point where the running
    thread c could continue, c's step is explored first (free); in the sibling branches that
    preempt c, c sleeps until something dependent on its step runs. A schedule skipped that way,
    n.u.A.c.B, has an explored twin n.c.u.A.B whose preemption count is never higher (c's step
    moves to where it was a free continuation), so the bound still covers every schedule up to
    reordering of independent steps. Only the continuing thread is put to sleep: at a forced
    switch the twin can cost one preemption more."""

    def __init__(self, bound: int, reduction: bool = True) -> None:
        self.bound = bound
        self.reduction = reduction
        self.label = f"bounded({bound})" + ("" if reduction else ", no reduction")
        self.queues: list[deque[tuple[list[int], Sleep]]] = [deque() for _ in range(bound + 1)]
        self.queues[0].append(([], {}))
        self.per_bound = {b: 0 for b in range(bound + 1)}
        self.redundant = 0
        self._level = 0
        self._prefix: list[int] = []
        self._entry: Sleep = {}

    def next(self) -> Chooser | None:
        while self._level <= self.bound and not self.queues[self._level]:
            self._level += 1
        if self._level > self.bound:
            return None
        self._prefix, self._entry = self.queues[self._level].popleft()
        self.per_bound[self._level] += 1
        return SleepChooser(self._prefix, self._entry) if self.reduction else PrefixChooser(self._prefix)

    def observe(self, execution: Execution) -> None:
        prefix, points = self._prefix, execution.points
        self.redundant += execution.outcome.value == "redundant"
        choices, preemptions = [c.chosen for c in points], 0
        last = len(prefix) - 1
        sleep: Sleep = dict(self._entry) if last >= 0 else {}
        for i, c in enumerate(points):
            if i > last and i > 0 and self.reduction:
                sleep = wake(sleep, c.point.touched)
            if i > last:
                after = points[i + 1].point.touched if i + 1 < len(points) else execution.tail
                continuing = c.point.current_enabled and c.chosen == c.point.current
                for alt in c.point.enabled:
                    if alt == c.chosen or (self.reduction and alt in sleep):
                        continue
                    cost = preemptions + (1 if c.point.current_enabled and alt != c.point.current else 0)
                    if cost <= self.bound:
                        child = dict(sleep) if self.reduction else {}
                        if self.reduction and continuing:
                            child[c.chosen] = after
                        self.queues[cost].append((choices[:i] + [alt], child))
            if c.preemptive:
                preemptions += 1

    @property
    def exhausted(self) -> bool:
        return not any(self.queues)


class PCTChooser:
    def __init__(self, seed: int, num_threads: int, depth: int, num_points: int) -> None:
        rng = random.Random(seed)
        order = list(range(num_threads))
        rng.shuffle(order)
        # higher runs first; initial priorities sit above every change-point priority
        self.priority = {t: depth + rank for rank, t in enumerate(order)}
        k = max(num_points, depth)
        self.change_at = dict(
            (at, depth - 1 - i) for i, at in enumerate(sorted(rng.sample(range(1, k + 1), depth - 1)))
        )

    def choose(self, point: PendingPoint) -> int:
        if point.index in self.change_at and point.current is not None:
            self.priority[point.current] = self.change_at[point.index]
        return max(point.enabled, key=lambda t: self.priority[t])


class PCTStrategy:
    """One run without preemptions to count choice points, then `runs` PCT runs from `seed`."""

    def __init__(self, num_threads: int, seed: int = 0, depth: int = 2, runs: int = 200) -> None:
        self.num_threads, self.seed, self.depth, self.runs = num_threads, seed, depth, runs
        self.label = f"pct(seed={seed}, depth={depth}, runs={runs})"
        self.per_bound: dict[int, int] = {}
        self.num_points: int | None = None
        self.started = 0

    def next(self) -> Chooser | None:
        if self.num_points is None:
            return PrefixChooser([])
        if self.started >= self.runs:
            return None
        self.started += 1
        return PCTChooser(self.seed + self.started - 1, self.num_threads, self.depth, self.num_points)

    def observe(self, execution: Execution) -> None:
        if self.num_points is None:
            self.num_points = max(len(execution.points), 1)

    @property
    def exhausted(self) -> bool:
        return False


Key = tuple[int, str, int]  # (thread, location, occurrence): where a decision is taken


class LaxReplayChooser:
    """Applies the recorded decisions where their (thread, location, occurrence) comes up;
    anything else takes the default. Used to shrink."""

    def __init__(self, decisions: dict[Key, int]) -> None:
        self.decisions = decisions

    def choose(self, point: PendingPoint) -> int:
        key = (point.current if point.current is not None else -1, point.location, point.occurrence)
        chosen = self.decisions.get(key)
        return chosen if chosen is not None and chosen in point.enabled else point.default


def decisions_of(execution: Execution) -> dict[Key, int]:
    """The choices that differ from the default, keyed by where they are taken."""
    out: dict[Key, int] = {}
    for c in execution.points:
        p = c.point
        if c.chosen != p.default:
            out[(p.current if p.current is not None else -1, p.location, p.occurrence)] = c.chosen
    return out
