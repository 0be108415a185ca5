"""Owns the built-in passcode scenarios: one checker shared by two threads, one sending the right
passcode and one a wrong one, as in the seed. A scenario per variant: `passcode:<variant>`.

The invariant is the seed's: the right passcode is accepted, the wrong one rejected. The
narrative shows the checker's writable state as labels ('right', 'wrong'), never the text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from isolab.race.checkers import VARIANTS
from isolab.race.explorer.scenario import Scenario, labels
from isolab.race.stress import RIGHT, WRONG

_show = labels([(RIGHT, "right"), (WRONG, "wrong"), ("", "''")])
# Writable state a checker might hold, in the order the narrative lists it.
_WATCHED = ("input_buffer", "buffer", "attempt", "result")


def _watch(checker: Any) -> str:
    parts = []
    for name in _WATCHED:
        if hasattr(checker, name):
            parts.append(f"{name}={_show(getattr(checker, name))}")
    local = getattr(checker, "local", None)
    if local is not None:
        parts.append(f"local.buffer={_show(getattr(local, 'buffer', ''))}")
    return " ".join(parts)


def _right(checker: Any) -> bool:
    return checker.check(RIGHT)


def _wrong(checker: Any) -> bool:
    return checker.check(WRONG)


def _check(checker: Any, results: tuple[Any, ...]) -> str | None:
    wrong, right = results
    if wrong is True:
        return "false accept: the wrong passcode was accepted"
    if right is False:
        return "false reject: the right passcode was rejected"
    return None


def passcode(variant: str) -> Scenario:
    factory = VARIANTS[variant].factory
    return Scenario(
        name=f"passcode:{variant}",
        setup=lambda: factory(RIGHT),
        threads=(_wrong, _right),  # the wrong sender starts: the first loss found is a false accept
        check=_check,
        thread_names=("wrong", "right"),
        watch=_watch,
        trace_modules=("isolab.race.checkers",),
        description=VARIANTS[variant].summary,
    )


def _make(variant: str) -> Callable[[], Scenario]:
    return lambda: passcode(variant)


SCENARIOS: dict[str, Callable[[], Scenario]] = {name: _make(name) for name in VARIANTS}
