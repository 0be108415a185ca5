"""The GIL model is checked against CPython itself: for every kind of switch point the model
claims (and every place it claims there is none), two real threads with a 1 us switch interval
lose updates exactly when the explorer's `--switch gil` search finds the loss. Not timed: each
stress run stops at its first loss, and a 'never' is a fixed number of iterations."""

from __future__ import annotations

import sys

import pytest

from isolab.errors import InvalidRequestError
from isolab.race.explorer import SwitchMode, bounded_search, gil
from isolab.race.explorer.api import explore
from isolab.race.fixtures import SCENARIOS as FIXTURES
from isolab.race.gil_stress import GADGETS, gadget_scenario, lost_updates, opposite_order_deadlocks, oversells

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the GIL model is CPython 3.11's")


@pytest.mark.parametrize("name", list(GADGETS))
def test_real_threads_and_the_gil_model_agree_on_each_switch_point(name: str) -> None:
    gadget, switches = GADGETS[name]
    real = lost_updates(gadget, iterations=20_000, trials=30)  # stops at its first loss
    assert (real > 0) is switches, f"CPython 3.11 {'can' if real else 'cannot'} switch inside: {gadget!r}"
    model = bounded_search(gadget_scenario(name), bound=2, mode=SwitchMode.GIL)
    assert model.exhausted or model.failure is not None
    assert (model.failure is not None) is switches, "the GIL model disagrees with the interpreter"


def test_back_edge_oversell_happens_with_real_threads_and_gil_mode_finds_it() -> None:
    assert oversells(runs=300, stock=1000, stop_at_first=True) == 1  # real threads oversell
    report = explore(FIXTURES["stock_oversell"](), SwitchMode.GIL, bound=2)
    assert report.finding is not None and report.finding.gil_reachable
    assert report.finding.execution.message == "oversold: stock is -1 after selling 2 items"
    assert any(c.point.what.startswith("LOAD_ATTR stock") and c.preemptive for c in report.finding.execution.points)
    fixed = bounded_search(FIXTURES["stock_oversell_fixed"](), bound=2, mode=SwitchMode.GIL)
    assert fixed.failure is None and fixed.exhausted


def test_without_the_while_back_edge_as_a_switch_point_the_oversell_is_missed(monkeypatch) -> None:
    # the protection switched off: the model as it was before (only JUMP_BACKWARD and CALL)
    monkeypatch.setattr(gil, "CHECK_AFTER_IF_TAKEN", frozenset())
    assert bounded_search(FIXTURES["stock_oversell"](), bound=2, mode=SwitchMode.GIL).failure is None


def test_uncontended_lock_acquires_are_no_switch_point() -> None:
    assert opposite_order_deadlocks(loop_between=True, runs=4_000) == 1  # the harness sees deadlocks
    assert opposite_order_deadlocks(loop_between=False, runs=2_000, stop_at_first=False) == 0
    assert bounded_search(FIXTURES["deadlock"](), bound=2, mode=SwitchMode.GIL).failure is None


@pytest.mark.parametrize("version", [(3, 10), (3, 12), (3, 13)])
def test_other_cpython_versions_are_refused_with_a_sentence(version: tuple[int, int]) -> None:
    with pytest.raises(InvalidRequestError, match=rf"models CPython 3.11.*this is Python {version[0]}\.{version[1]}"):
        gil.check_supported(version)
    gil.check_supported((3, 11))
