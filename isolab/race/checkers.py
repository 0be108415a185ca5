"""Owns the passcode checkers: the seed's buggy one verbatim, its fixes, and their mutants.

Every checker has the same interface: `Checker(correct)` then `check(candidate) -> bool`, and may
be shared by any number of threads. A *mutant* is a fix with its protection taken out again; the
vacuity check runs it to show that the tests which pass the fix would have caught the bug.

    variant          shared mutable state            protection
    buggy            input_buffer, result            none (the seed, section 2.1)
    lock_local       none                            lock + local variable (seed, section 3.1)
    lock_shared      input_buffer                    lock only
    local            none                            local variable only
    thread_local     one buffer per thread           threading.local (seed, section 3.2)
    immutable        none; the checker is frozen     immutable sharing (seed, section 3.3)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from isolab.errors import InvalidRequestError


class Checker(Protocol):
    def check(self, candidate: str) -> bool: ...


# --- the seed, section 2.1, as written (comments translated) ---------------------------------
class PasscodeChecker:
    def __init__(self, correct):
        self.correct = correct
        self.input_buffer = ""  # shared mutable state
        self.result = None  # shared mutable state

    def check(self, candidate):
        self.input_buffer = candidate
        # simulate a little work, to widen the race window
        for _ in range(1000):
            pass
        self.result = (self.input_buffer == self.correct)
        return self.result


# --- the seed, section 3.1: lock + local variable ---------------------------------------------
class LockedLocalChecker:
    def __init__(self, correct):
        self.correct = correct
        self.lock = threading.Lock()

    def check(self, candidate):
        with self.lock:
            buffer = candidate
            for _ in range(1000):
                pass
            return buffer == self.correct


class LockedSharedChecker:
    """The lock alone: the buffer is still an attribute, but only the lock holder touches it."""

    def __init__(self, correct):
        self.correct = correct
        self.input_buffer = ""
        self.lock = threading.Lock()

    def check(self, candidate):
        with self.lock:
            self.input_buffer = candidate
            for _ in range(1000):
                pass
            return self.input_buffer == self.correct


class LocalChecker:
    """The local variable alone: nothing shared is written, so nothing needs a lock."""

    def __init__(self, correct):
        self.correct = correct

    def check(self, candidate):
        buffer = candidate
        for _ in range(1000):
            pass
        return buffer == self.correct


# --- the seed, section 3.2: threading.local ---------------------------------------------------
class ThreadLocalChecker:
    def __init__(self, correct):
        self.correct = correct
        self.local = threading.local()

    def check(self, candidate):
        self.local.buffer = candidate
        for _ in range(1000):
            pass
        return self.local.buffer == self.correct


# --- the seed, section 3.3: immutable sharing -------------------------------------------------
@dataclass(frozen=True)  # not slots=True: on 3.11 that breaks the frozen __setattr__
class ImmutableChecker:
    """Shared read-only: a frozen checker has nowhere to put a buffer (a write raises)."""

    correct: str

    def check(self, candidate):
        buffer = candidate
        for _ in range(1000):
            pass
        return buffer == self.correct


# --- mutants: each fix with its protection removed --------------------------------------------
class LockSharedNoLock:
    """lock_shared without its lock."""

    def __init__(self, correct):
        self.correct = correct
        self.input_buffer = ""

    def check(self, candidate):
        self.input_buffer = candidate
        for _ in range(1000):
            pass
        return self.input_buffer == self.correct


class LocalMadeShared:
    """local with the local variable made an attribute again."""

    def __init__(self, correct):
        self.correct = correct
        self.buffer = ""

    def check(self, candidate):
        self.buffer = candidate
        for _ in range(1000):
            pass
        return self.buffer == self.correct


class ThreadLocalMadeShared:
    """thread_local with threading.local() replaced by one object that all threads share."""

    def __init__(self, correct):
        self.correct = correct
        self.local = _Namespace()

    def check(self, candidate):
        self.local.buffer = candidate
        for _ in range(1000):
            pass
        return self.local.buffer == self.correct


class _Namespace:
    buffer: str


@dataclass(slots=True)
class ImmutableThawed:
    """immutable made mutable again: the attempt is parked on the shared checker."""

    correct: str
    attempt: str = ""

    def check(self, candidate):
        self.attempt = candidate
        for _ in range(1000):
            pass
        return self.attempt == self.correct


class LockLocalStripped:
    """lock_local with both protections removed (either one alone still suffices)."""

    def __init__(self, correct):
        self.correct = correct
        self.buffer = ""

    def check(self, candidate):
        self.buffer = candidate
        for _ in range(1000):
            pass
        return self.buffer == self.correct


@dataclass(frozen=True)
class Variant:
    name: str
    factory: Callable[[str], Checker]
    racy: bool  # True: false accepts/rejects are the expected (known) outcome, not a failure
    summary: str


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("buggy", PasscodeChecker, True, "the seed's checker: shared input_buffer, no lock"),
        Variant("lock_local", LockedLocalChecker, False, "lock + local variable (seed 3.1)"),
        Variant("lock_shared", LockedSharedChecker, False, "lock only, buffer still shared"),
        Variant("local", LocalChecker, False, "local variable only, no lock"),
        Variant("thread_local", ThreadLocalChecker, False, "threading.local (seed 3.2)"),
        Variant("immutable", ImmutableChecker, False, "frozen checker, read-only sharing (seed 3.3)"),
        Variant("lock_shared-nolock", LockSharedNoLock, True, "mutant: lock_shared without its lock"),
        Variant("local-shared", LocalMadeShared, True, "mutant: local made shared again"),
        Variant("thread_local-shared", ThreadLocalMadeShared, True, "mutant: one shared namespace"),
        Variant("immutable-thawed", ImmutableThawed, True, "mutant: mutable checker holds the attempt"),
        Variant("lock_local-stripped", LockLocalStripped, True, "mutant: lock and local both removed"),
    )
}

FIXES: tuple[str, ...] = ("lock_local", "lock_shared", "local", "thread_local", "immutable")

# The vacuity check: fix -> the same code with its protection removed.
MUTANT_OF: dict[str, str] = {
    "lock_local": "lock_local-stripped",
    "lock_shared": "lock_shared-nolock",
    "local": "local-shared",
    "thread_local": "thread_local-shared",
    "immutable": "immutable-thawed",
}


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        known = ", ".join(VARIANTS)
        raise InvalidRequestError(f"unknown variant {name!r}; known: {known}", field="variant") from None


def parse_variants(text: str) -> list[Variant]:
    """'all' -> seed variants + fixes; otherwise a comma list of names."""
    if text == "all":
        return [VARIANTS["buggy"], *(VARIANTS[n] for n in FIXES)]
    return [get_variant(n.strip()) for n in text.split(",") if n.strip()]
