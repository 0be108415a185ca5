"""Owns the known-buggy fixtures the explorer must catch (and their fixed twins, which it must
pass): a lost update, a two-lock deadlock, check-then-act, a lost wake-up on a Condition, and
the back-edge oversell (a `while` loop whose back edge is a GIL switch point).

Each is the smallest program with the bug; `fixtures:<name>` names one on the command line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

from isolab.race.explorer.scenario import Scenario


# --- lost update: two unsynchronised read-modify-writes of one counter ------------------------
class Counter:
    def __init__(self):
        self.value = 0
        self.lock = threading.Lock()

    def increment(self):
        self.value += 1  # LOAD_ATTR, BINARY_OP, STORE_ATTR: no GIL switch point inside on 3.11

    def increment_locked(self):
        with self.lock:
            self.value += 1


def _counter_check(counter: Counter, results: tuple) -> str | None:
    return None if counter.value == 2 else f"lost update: counter is {counter.value} after 2 increments"


def lost_update() -> Scenario:
    return Scenario("fixtures:lost_update", Counter, (Counter.increment, Counter.increment), _counter_check,
                    watch=lambda c: f"value={c.value}")


def lost_update_fixed() -> Scenario:
    return Scenario("fixtures:lost_update_fixed", Counter, (Counter.increment_locked, Counter.increment_locked),
                    _counter_check, watch=lambda c: f"value={c.value}")


# --- two-lock deadlock: opposite acquisition order ---------------------------------------------
def _two_locks() -> SimpleNamespace:
    return SimpleNamespace(a=threading.Lock(), b=threading.Lock(), done=0)


def _a_then_b(s: SimpleNamespace) -> None:
    with s.a:
        with s.b:
            s.done += 1


def _b_then_a(s: SimpleNamespace) -> None:
    with s.b:
        with s.a:
            s.done += 1


def deadlock() -> Scenario:
    return Scenario("fixtures:deadlock", _two_locks, (_a_then_b, _b_then_a), lambda s, r: None,
                    watch=lambda s: f"a={'held' if s.a.locked() else 'free'} b={'held' if s.b.locked() else 'free'}")


def deadlock_fixed() -> Scenario:
    return Scenario("fixtures:deadlock_fixed", _two_locks, (_a_then_b, _a_then_b), lambda s, r: None)


# --- check-then-act: two threads both see "absent" and both create ----------------------------
def _cache() -> SimpleNamespace:
    return SimpleNamespace(entries={}, created=0, lock=threading.Lock())


def _create(s: SimpleNamespace) -> object:
    s.created += 1
    return object()


def _get_or_create(s: SimpleNamespace) -> object:
    if "key" not in s.entries:
        s.entries["key"] = _create(s)
    return s.entries["key"]


def _get_or_create_locked(s: SimpleNamespace) -> object:
    with s.lock:
        if "key" not in s.entries:
            s.entries["key"] = _create(s)
        return s.entries["key"]


def _one_instance(s: SimpleNamespace, results: tuple) -> str | None:
    if s.created != 1 or results[0] is not results[1]:
        return f"check-then-act: {s.created} instances created, callers got different objects"
    return None


def check_then_act() -> Scenario:
    return Scenario("fixtures:check_then_act", _cache, (_get_or_create, _get_or_create), _one_instance,
                    watch=lambda s: f"created={s.created}")


def check_then_act_fixed() -> Scenario:
    return Scenario("fixtures:check_then_act_fixed", _cache, (_get_or_create_locked, _get_or_create_locked),
                    _one_instance, watch=lambda s: f"created={s.created}")


# --- lost wake-up: the flag is tested outside the condition's lock ------------------------------
def _mailbox() -> SimpleNamespace:
    return SimpleNamespace(cond=threading.Condition(), ready=False)


def _consumer(s: SimpleNamespace) -> str:
    if not s.ready:  # tested without the lock: the notify can slip in before the wait
        with s.cond:
            s.cond.wait()
    return "woken"


def _consumer_fixed(s: SimpleNamespace) -> str:
    with s.cond:
        while not s.ready:
            s.cond.wait()
    return "woken"


def _producer(s: SimpleNamespace) -> None:
    with s.cond:
        s.ready = True
        s.cond.notify()


def lost_wakeup() -> Scenario:
    return Scenario("fixtures:lost_wakeup", _mailbox, (_consumer, _producer), lambda s, r: None,
                    thread_names=("consumer", "producer"), watch=lambda s: f"ready={s.ready}")


def lost_wakeup_fixed() -> Scenario:
    return Scenario("fixtures:lost_wakeup_fixed", _mailbox, (_consumer_fixed, _producer), lambda s, r: None,
                    thread_names=("consumer", "producer"), watch=lambda s: f"ready={s.ready}")


# --- back-edge oversell: the check and the sale are separated by the loop's back edge ----------
def _shop() -> SimpleNamespace:
    return SimpleNamespace(stock=2, lock=threading.Lock())


def _sell_all(s: SimpleNamespace) -> None:
    while s.stock > 0:  # POP_JUMP_BACKWARD_IF_TRUE: CPython 3.11 may switch threads right after the check
        s.stock -= 1


def _sell_all_locked(s: SimpleNamespace) -> None:
    while True:
        with s.lock:
            if s.stock <= 0:
                return
            s.stock -= 1


def _not_oversold(s: SimpleNamespace, results: tuple) -> str | None:
    return None if s.stock == 0 else f"oversold: stock is {s.stock} after selling 2 items"


def stock_oversell() -> Scenario:
    return Scenario("fixtures:stock_oversell", _shop, (_sell_all, _sell_all), _not_oversold,
                    watch=lambda s: f"stock={s.stock}")


def stock_oversell_fixed() -> Scenario:
    return Scenario("fixtures:stock_oversell_fixed", _shop, (_sell_all_locked, _sell_all_locked), _not_oversold,
                    watch=lambda s: f"stock={s.stock}")


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    f.__name__: f
    for f in (lost_update, lost_update_fixed, deadlock, deadlock_fixed, check_then_act, check_then_act_fixed,
              lost_wakeup, lost_wakeup_fixed, stock_oversell, stock_oversell_fixed)
}
