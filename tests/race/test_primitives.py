"""Every modelled primitive goes through the one blocking path (blocking.operation): a sync point
before each operation, `after_sync` after it on every path, and a guard that parks a thread only
before an operation that would wait with no timeout. Each test here failed on a primitive that
hand-rolled or skipped part of that path (the regressions are named in each test)."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from isolab.race.explorer import Scenario, SwitchMode, bounded_search, load
from isolab.race.explorer.primitives import ModelCondition, ModelEvent, ModelLock, ModelRLock, ModelSemaphore


class Recorder:
    """A types.Scheduler that records the path each operation takes; it never switches."""

    aborted = False
    silent = False

    def __init__(self) -> None:
        self.task: Any = SimpleNamespace(name="T0")
        self.events: list[tuple[Any, ...]] = []

    def me(self) -> Any:
        return self.task

    def managed(self) -> bool:
        return True

    def sync_point(self, what: str, c_level: bool, yielding: bool = False, guard: Any = None,
                   read: bool = False) -> Any:
        self.events.append(("sync", what.rpartition(".")[2], c_level, guard is not None, read))
        return self.task

    def after_sync(self, task: Any, c_level: bool = False) -> None:
        self.events.append(("after", c_level))

    def block(self, task: Any, ready: Callable[[], bool], waiting_for: Callable[[], str], timed: bool = False) -> bool:
        if ready():
            return True
        assert timed, f"would wait forever: {waiting_for()}"
        return False  # virtual time ran out

    def name_of(self, obj: object, kind: str) -> str:
        return "p"

    def created(self, obj: Any) -> None:
        pass

    def unsupported(self, why: str) -> None:
        raise AssertionError(why)


def _paired(events: list[tuple[Any, ...]]) -> bool:
    """Each sync point is closed by an after_sync of the same level, innermost first."""
    stack: list[bool] = []
    for event in events:
        if event[0] == "sync":
            stack.append(event[2])
        elif not stack or stack.pop() != event[1]:
            return False
    return not stack


def _held_by_another(lock: ModelLock) -> ModelLock:
    lock.owner = SimpleNamespace(name="T1")
    return lock


def _with(primitive: Any) -> None:
    with primitive:
        pass


# (primitive, operation, its result or the exception it raises, the sync points in order:
#  (op, Python-level, guarded, read))
CASES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any], Any, list[tuple[str, bool, bool, bool]]]] = {
    # ModelSemaphore.acquire(blocking=False) once returned before after_sync
    "Semaphore.acquire(blocking=False), unavailable": (
        lambda rt: ModelSemaphore(rt, 0), lambda p: p.acquire(blocking=False), False, [("acquire", True, False, False)]),
    "Semaphore.acquire(timeout=1), unavailable": (
        lambda rt: ModelSemaphore(rt, 0), lambda p: p.acquire(timeout=1), False, [("acquire", True, False, False)]),
    "Semaphore.acquire()": (
        lambda rt: ModelSemaphore(rt, 1), lambda p: p.acquire(), True, [("acquire", True, True, False)]),
    "BoundedSemaphore.release() too many": (
        lambda rt: ModelSemaphore(rt, 1, bound=1), lambda p: p.release(), ValueError, [("release", True, False, False)]),
    "Lock.acquire(False), held": (
        lambda rt: _held_by_another(ModelLock(rt)), lambda p: p.acquire(False), False, [("acquire", False, False, False)]),
    "Lock.acquire(timeout=0.5), held": (
        lambda rt: _held_by_another(ModelLock(rt)), lambda p: p.acquire(timeout=0.5), False,
        [("acquire", False, False, False)]),
    "Lock.acquire()": (lambda rt: ModelLock(rt), lambda p: p.acquire(), True, [("acquire", False, True, False)]),
    "Lock.release(), unlocked": (lambda rt: ModelLock(rt), lambda p: p.release(), RuntimeError,
                                 [("release", False, False, False)]),
    "Lock.locked()": (lambda rt: ModelLock(rt), lambda p: p.locked(), False, [("locked", False, False, True)]),
    "RLock.acquire(blocking=False), held": (
        lambda rt: _held_by_another(ModelRLock(rt)), lambda p: p.acquire(blocking=False), False,
        [("acquire", False, False, False)]),
    # ModelCondition.acquire hand-rolled its sync point and never called after_sync
    "Condition.acquire()": (
        lambda rt: ModelCondition(rt), lambda p: p.acquire(), True,
        [("acquire", True, True, False), ("acquire", False, True, False)]),
    "Condition.acquire(False), held": (
        lambda rt: ModelCondition(rt, _held_by_another(ModelLock(rt))), lambda p: p.acquire(False), False,
        [("acquire", True, False, False), ("acquire", False, False, False)]),
    # Condition.__exit__ released the lock with no Python-level sync point
    "with Condition": (
        lambda rt: ModelCondition(rt), _with, None,
        [("acquire", True, True, False), ("acquire", False, True, False),
         ("release", True, False, False), ("release", False, False, False)]),
    "Condition.wait(timeout=1), not notified": (
        lambda rt: ModelCondition(rt), lambda p: (p.acquire(), p.wait(timeout=1))[1], False,
        [("acquire", True, True, False), ("acquire", False, True, False), ("wait", True, False, False)]),
    "Event.wait(timeout=1), not set": (
        lambda rt: ModelEvent(rt), lambda p: p.wait(timeout=1), False, [("wait", True, False, False)]),
    "Event.wait()": (lambda rt: ModelEvent(rt), lambda p: (p.set(), p.wait())[1], True,
                     [("set", True, False, False), ("wait", True, True, False)]),
    # Event.is_set and Lock.locked read the primitive with no sync point at all
    "Event.is_set()": (lambda rt: ModelEvent(rt), lambda p: p.is_set(), False, [("is_set", True, False, True)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_operation_takes_the_one_path_on_every_exit(case: str) -> None:
    make, operate, expected, syncs = CASES[case]
    rt = Recorder()
    primitive = make(rt)
    if isinstance(expected, type) and issubclass(expected, Exception):  # after_sync all the same
        with pytest.raises(expected):
            operate(primitive)
    else:
        assert operate(primitive) == expected
    assert _paired(rt.events), f"unpaired sync points: {rt.events}"
    assert [e[1:] for e in rt.events if e[0] == "sync"] == [(op, not py, guarded, read)
                                                             for op, py, guarded, read in syncs]


def test_queries_outside_a_managed_thread_or_in_a_watch_just_read() -> None:
    rt = Recorder()
    event, lock = ModelEvent(rt), ModelLock(rt)
    rt.task = None  # the explorer's own thread: a scenario's check
    assert event.is_set() is False and lock.locked() is False
    rt.task, rt.silent = SimpleNamespace(name="T0"), True  # a narrative's watch
    assert event.is_set() is False and lock.locked() is False
    assert rt.events == []


def _state() -> SimpleNamespace:
    return SimpleNamespace(sem=threading.Semaphore(0), event=threading.Event(), cond=threading.Condition(),
                           got=None, y=0, x=0, seen=None, flag=False, a=0, r=None)


@pytest.mark.parametrize("attempt", ["s.sem.acquire(blocking=False)", "s.sem.acquire(False)",
                                     "s.sem.acquire(timeout=1)", "s.event.wait(timeout=1)", "s.event.wait(1)"])
@pytest.mark.parametrize("mode", [SwitchMode.GIL, SwitchMode.OPCODE])
def test_an_attempt_that_need_not_wait_is_never_a_deadlock(tmp_path: Path, attempt: str, mode: SwitchMode) -> None:
    """The guard once parked a thread before `sem.acquire(blocking=False)` as if it would block:
    with nobody to release, the search reported a deadlock where the call returns False."""
    path = tmp_path / "attempt.py"
    path.write_text(textwrap.dedent(f"""
        import threading
        from types import SimpleNamespace
        from isolab.race.explorer import Scenario

        def trier(s):
            s.got = {attempt}

        def other(s):
            s.y = 1

        def scenario():
            return Scenario("attempt", lambda: SimpleNamespace(sem=threading.Semaphore(0), event=threading.Event(),
                                                               got=None, y=0),
                            (trier, other), lambda s, r: None if s.got is False else f"got {{s.got}}")
    """))
    result = bounded_search(load(f"{path}:scenario"), bound=2, mode=mode)
    assert result.failure is None and result.exhausted, result.failure and result.failure.verdict


def _probe_held(s: SimpleNamespace) -> None:
    if s.cond.acquire(False):
        s.cond.release()
    else:
        s.seen = s.x


def _update_under_cond(s: SimpleNamespace) -> None:
    with s.cond:
        s.x = 1
        s.x = 2


def test_a_non_blocking_probe_sees_a_condition_held_mid_update() -> None:
    """The guard once parked `cond.acquire(False)` until the holder released: the probe never saw
    the condition held, and even the free-threaded search missed the torn state."""
    scenario = Scenario("probe", _state, (_update_under_cond, _probe_held),
                        lambda s, r: f"saw x == {s.seen} under the condition" if s.seen is not None else None)
    for reduction in (True, False):
        found = bounded_search(scenario, bound=2, mode=SwitchMode.OPCODE, reduction=reduction)
        assert found.failure is not None and found.failure.message in ("saw x == 0 under the condition",
                                                                      "saw x == 1 under the condition")
    # entering Condition.__exit__ (Python code) is a switch point: with the GIL, x == 2 is seen too
    assert "saw x == 2 under the condition" in _messages(scenario, SwitchMode.GIL)


def _messages(scenario: Scenario, mode: SwitchMode) -> set[str]:
    seen: set[str] = set()
    bounded_search(scenario, bound=2, mode=mode, count_all=True,
                   on_execution=lambda e: seen.add(e.message or "") if e.failed else None)
    return seen


def _flag_under_cond(s: SimpleNamespace) -> None:
    with s.cond:
        s.flag = True


def _wait_then_probe(s: SimpleNamespace) -> None:
    with s.cond:
        s.a = 2
    if s.cond.acquire(False):
        s.cond.release()
    else:
        s.seen = s.flag


def test_with_the_gil_a_thread_can_lose_the_cpu_right_after_taking_a_condition() -> None:
    """Condition.__enter__ is Python code: after the lock's C acquire returns, CALL checks the
    eval breaker. after_sync once skipped that switch point whenever the acquire had been a choice
    point itself, so the GIL-faithful search could not see the condition held before the flag."""
    scenario = Scenario("window", _state, (_flag_under_cond, _wait_then_probe),
                        lambda s, r: "held, flag not yet set" if s.seen is False else None)
    for mode in (SwitchMode.GIL, SwitchMode.OPCODE):
        found = bounded_search(scenario, bound=2, mode=mode)
        assert found.failure is not None and found.failure.message == "held, flag not yet set", mode


def _set_after_read(s: SimpleNamespace) -> None:
    v = s.a
    s.event.set()
    s.seen = v


def _write_then_check(s: SimpleNamespace) -> None:
    s.a = 1
    s.r = s.event.is_set()


@pytest.mark.parametrize("mode", [SwitchMode.GIL, SwitchMode.OPCODE])
def test_event_is_set_is_an_operation_other_threads_do_not_commute_with(mode: SwitchMode) -> None:
    """Event.is_set once read the flag outside the model: with the GIL, entering it (Python code)
    was no switch point, so the search held; and its read was in no footprint."""
    scenario = Scenario("is_set", _state, (_set_after_read, _write_then_check),
                        lambda s, r: "set seen after a=1 was read" if s.seen == 1 and s.r is True else None)
    for reduction in (True, False):
        found = bounded_search(scenario, bound=2, mode=mode, reduction=reduction)
        assert found.failure is not None and found.failure.message == "set seen after a=1 was read"


def test_a_check_and_a_watch_may_call_the_queries() -> None:
    def body(s: SimpleNamespace) -> None:
        with s.lock:
            s.event.set()

    scenario = Scenario("queries", lambda: SimpleNamespace(lock=threading.Lock(), event=threading.Event()),
                        (body, body),
                        lambda s, r: None if s.event.is_set() and not s.lock.locked() else "wrong end state",
                        watch=lambda s: f"set={s.event.is_set()} held={s.lock.locked()}")
    result = bounded_search(scenario, bound=2, mode=SwitchMode.OPCODE)
    assert result.failure is None and result.exhausted and result.inconclusive is None
