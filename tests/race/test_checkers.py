"""The checkers: same interface, right answers alone, and a mutant for every fix."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from isolab.errors import InvalidRequestError
from isolab.race import checkers
from isolab.race.checkers import FIXES, MUTANT_OF, VARIANTS, get_variant, parse_variants


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_is_right_on_one_thread(name: str) -> None:
    checker = VARIANTS[name].factory("secret")
    assert checker.check("secret") is True
    assert checker.check("other") is False


def test_the_buggy_checker_is_the_seeds_code() -> None:
    source = inspect.getsource(checkers.PasscodeChecker.check)
    assert "self.input_buffer = candidate" in source
    assert "for _ in range(1000):" in source
    assert "self.result = (self.input_buffer == self.correct)" in source


def test_every_fix_has_a_racy_mutant_and_no_fix_is_racy() -> None:
    assert set(MUTANT_OF) == set(FIXES)
    for fix, mutant in MUTANT_OF.items():
        assert not VARIANTS[fix].racy
        assert VARIANTS[mutant].racy


def test_immutable_checker_refuses_a_buffer() -> None:
    checker = VARIANTS["immutable"].factory("secret")
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
        checker.input_buffer = "x"  # type: ignore[attr-defined]


def test_unknown_variant_is_a_user_error() -> None:
    with pytest.raises(InvalidRequestError):
        get_variant("nope")
    assert [v.name for v in parse_variants("all")] == ["buggy", *FIXES]
    assert [v.name for v in parse_variants("buggy, local")] == ["buggy", "local"]
