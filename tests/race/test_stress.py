"""The load harness counts every outcome; real threads catch the buggy checker and not a fix.

Stress is probabilistic, so the racy side retries until it sees a forbidden outcome (bounded by a
number of runs, never by a clock), and the fixed side runs the same load that caught the bug."""

from __future__ import annotations

import pytest

from isolab.errors import InvalidRequestError
from isolab.race.checkers import FIXES, MUTANT_OF, VARIANTS
from isolab.race.stress import StressConfig, run_once

LOAD = StressConfig(threads=4, requests=20_000, switch_interval=1e-6)


def _forbidden_seen(name: str, tries: int = 8) -> bool:
    for _ in range(tries):
        r = run_once(VARIANTS[name], LOAD)
        if r.false_accepts + r.false_rejects:
            return True
    return False


def test_outcomes_add_up() -> None:
    r = run_once(VARIANTS["buggy"], StressConfig(threads=3, requests=301, right_share=1 / 3))
    assert r.true_accepts + r.false_rejects == 101  # one right thread gets the remainder request
    assert r.false_accepts + r.true_rejects == 200
    assert r.requests == 301 and r.seconds > 0


def test_buggy_checker_loses_under_load() -> None:
    assert _forbidden_seen("buggy")


@pytest.mark.parametrize("fix", ["lock_local", "thread_local"])
def test_fix_holds_under_the_load_that_breaks_its_mutant(fix: str) -> None:
    r = run_once(VARIANTS[fix], LOAD)
    assert (r.false_accepts, r.false_rejects) == (0, 0)
    assert _forbidden_seen(MUTANT_OF[fix])  # vacuity: the same load catches the fix removed


def test_fix_list_is_covered_by_the_explorer_tests_too() -> None:
    assert set(FIXES) == {"lock_local", "lock_shared", "local", "thread_local", "immutable"}


@pytest.mark.parametrize(
    "kwargs", [dict(threads=0, requests=10), dict(threads=4, requests=2), dict(threads=2, requests=10, right_share=2.0),
               dict(threads=2, requests=10, switch_interval=0.0)]
)
def test_bad_config_is_a_user_error(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        StressConfig(**kwargs)
