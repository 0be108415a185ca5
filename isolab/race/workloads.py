"""Owns the explorer's cost workloads: correct programs whose whole bounded search the bench
times (issue 18's figures): a 3x3 Lock counter and a 3-thread bounded buffer on a Condition.
`workloads:<name>` names one on the command line."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

from isolab.race.explorer.scenario import Scenario


def _counter() -> SimpleNamespace:
    return SimpleNamespace(lock=threading.Lock(), value=0)


def _increment_3(s: SimpleNamespace) -> None:
    for _ in range(3):
        with s.lock:
            s.value += 1


def counter_3x3() -> Scenario:
    """Three threads, three locked increments each: 9 at the end in every schedule."""
    return Scenario("workloads:counter_3x3", _counter, (_increment_3,) * 3,
                    lambda s, r: None if s.value == 9 else f"counter is {s.value}, not 9",
                    watch=lambda s: f"value={s.value}")


class Buffer:
    """A one-slot bounded buffer: put waits while full, get waits while empty."""

    def __init__(self, capacity: int = 1) -> None:
        self.cond = threading.Condition()
        self.items: list[int] = []
        self.capacity = capacity

    def put(self, x: int) -> None:
        with self.cond:
            while len(self.items) >= self.capacity:
                self.cond.wait()
            self.items.append(x)
            self.cond.notify_all()

    def get(self) -> int:
        with self.cond:
            while not self.items:
                self.cond.wait()
            x = self.items.pop(0)
            self.cond.notify_all()
            return x


def _produce_two(b: Buffer) -> None:
    b.put(1)
    b.put(2)


def _consume_one(b: Buffer) -> int:
    return b.get()


def bounded_buffer() -> Scenario:
    """One producer of two items, two consumers of one each: they get 1 and 2 between them."""
    return Scenario("workloads:bounded_buffer", Buffer, (_produce_two, _consume_one, _consume_one),
                    lambda b, r: None if sorted(r[1:]) == [1, 2] else f"consumers got {r[1:]}",
                    thread_names=("producer", "consumer1", "consumer2"), watch=lambda b: f"items={b.items}")


SCENARIOS: dict[str, Callable[[], Scenario]] = {f.__name__: f for f in (counter_3x3, bounded_buffer)}
