"""Owns the real-thread side of the GIL model's check: two OS threads race around a *gadget*
placed between a read and a write of a shared counter, under CPython itself with a 1 us switch
interval, and we count lost updates. A gadget with an eval-breaker check (a switch point)
loses updates within a few thousand iterations; one without never does. The same gadget,
explored in `--switch gil` mode, must lose exactly when the real threads do
(tests/race/test_gil_model.py); `gadget_scenario` builds that scenario.

Also the issue's back-edge oversell (`while s.stock > 0: s.stock -= 1`) with real threads.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from isolab.race.explorer.scenario import Scenario

# name -> (gadget source, True when CPython 3.11 can switch threads inside it)
GADGETS: dict[str, tuple[str, bool]] = {
    "nothing": ("pass", False),
    "arithmetic on locals": ("w = v * 3 + 1", False),
    "for loop (JUMP_BACKWARD)": ("for _ in (1, 2):\n    pass", True),
    "while i (POP_JUMP_BACKWARD_IF_TRUE)": ("i = 2\nwhile i:\n    i -= 1", True),
    "while not (POP_JUMP_BACKWARD_IF_FALSE)": ("i = -1\nwhile not i > 0:\n    i += 1", True),
    "while is None (POP_JUMP_BACKWARD_IF_NONE)": ("w = None\nj = 0\nwhile w is None:\n    w = starts[j]\n    j += 1", True),
    "while is not None (POP_JUMP_BACKWARD_IF_NOT_NONE)": ("w = 1\nj = 0\nwhile w is not None:\n    w = ends[j]\n    j += 1", True),
    "Python call (RESUME)": ("noop()", True),
    "C call abs() (CALL)": ("abs(v)", True),
    "C method d.get() (CALL)": ("d.get(1)", True),
    "class call str() (CALL)": ("str(v)", True),
    "len() (specialised, no check)": ("len(ones)", False),
    "isinstance() (specialised, no check)": ("isinstance(v, int)", False),
    "type(x) (specialised, no check)": ("type(v)", False),
    "list.append (specialised, no check)": ("scratch.append(1)", False),
}


def noop() -> None:
    pass


def _compile(gadget: str, name: str) -> Callable[..., Any]:
    """A body `(s, n)` that does n times: v = s.x; <gadget>; s.x = v + 1."""
    body = textwrap.indent(gadget, " " * 8)
    source = (f"def {name}(s, n=1):\n    ones, ends, starts, d, scratch = (1,), (1, None), (None, 1), {{}}, []\n"
              f"    for _ in range(n):\n        v = s.x\n{body}\n        s.x = v + 1\n")
    namespace: dict[str, Any] = {"noop": noop}
    exec(compile(source, f"<gadget {name}>", "exec"), namespace)
    return namespace[name]


@contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _started_together(body: Callable[[SimpleNamespace], None], s: SimpleNamespace) -> list[threading.Thread]:
    barrier = threading.Barrier(2)

    def run() -> None:
        barrier.wait()
        body(s)

    return [threading.Thread(target=run) for _ in range(2)]


def lost_updates(gadget: str, iterations: int = 20_000, trials: int = 3, stop_at_first: bool = True) -> int:
    """Updates lost by two real threads running the gadget body `iterations` times each."""
    body = _compile(gadget, "gadget")
    body(SimpleNamespace(x=0), 64)  # warm up: the model follows specialised (warmed-up) bytecode
    lost = 0
    with switch_interval(1e-6):
        for _ in range(trials):
            s = SimpleNamespace(x=0)
            # started together: on a loaded machine the first thread could otherwise finish its loop
            # before the second was scheduled, and a switch point would read as none
            threads = _started_together(lambda s: body(s, iterations), s)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            lost += 2 * iterations - s.x
            if lost and stop_at_first:
                break
    return lost


def gadget_scenario(name: str) -> Scenario:
    gadget, _ = GADGETS[name]
    body = _compile(gadget, "gadget")
    return Scenario(f"gadget:{name}", lambda: SimpleNamespace(x=0), (body, body),
                    lambda s, r: None if s.x == 2 else f"lost update: x is {s.x} after 2 increments",
                    trace_modules=(__name__,), trace_dirs=())


# --- the back-edge oversell ------------------------------------------------------------------
def sell_all(s: SimpleNamespace) -> None:
    while s.stock > 0:  # the loop's back edge is a POP_JUMP_BACKWARD_IF_TRUE: a GIL switch point
        s.stock -= 1


def oversells(runs: int = 3_000, stock: int = 2, interval: float = 1e-6, stop_at_first: bool = False) -> int:
    """Runs (of `runs`) in which two real threads running sell_all drove the stock below 0."""
    count = 0
    with switch_interval(interval):
        for _ in range(runs):
            s = SimpleNamespace(stock=stock)
            threads = _started_together(sell_all, s)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            count += s.stock < 0
            if count and stop_at_first:
                break
    return count


# --- two locks taken in opposite order (fixtures:deadlock's shape) ----------------------------
def opposite_order_deadlocks(loop_between: bool, runs: int = 2_000, stop_at_first: bool = True) -> int:
    """Runs in which two real threads, each taking two locks once in opposite order, got stuck
    (an inner acquire timed out). Without a switch point between the acquires CPython 3.11 never
    switches there, so this stays 0; a loop between them (back edges) makes it happen."""
    stuck = 0
    with switch_interval(1e-6):
        for _ in range(runs):
            s = SimpleNamespace(a=threading.Lock(), b=threading.Lock(), stuck=0)

            barrier = threading.Barrier(2)

            def a_then_b(s: SimpleNamespace = s, barrier: threading.Barrier = barrier) -> None:  # no call between the acquires
                barrier.wait()
                with s.a:
                    if loop_between:
                        for _ in range(2_000):
                            pass
                    if s.b.acquire(True, 0.05):  # the call's check comes after it returns
                        s.b.release()
                    else:
                        s.stuck += 1

            def b_then_a(s: SimpleNamespace = s, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                with s.b:
                    if loop_between:
                        for _ in range(2_000):
                            pass
                    if s.a.acquire(True, 0.05):
                        s.a.release()
                    else:
                        s.stuck += 1

            threads = [threading.Thread(target=a_then_b), threading.Thread(target=b_then_a)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stuck += s.stuck > 0
            if stuck and stop_at_first:
                break
    return stuck
