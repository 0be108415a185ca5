"""Each protection holds on a healthy engine, and its fault is caught (claim C14: reproduce first).

The same scenario and the same checks run twice: with the protection on they must stay silent,
with it off they must fire; so no check here can pass by being unable to fail."""

from __future__ import annotations

import pytest

from isolab.engine.selftest import SCENARIOS, run_scenario

IDS = [s.fault for s in SCENARIOS]


@pytest.mark.parametrize("sc", SCENARIOS, ids=IDS)
def test_protection_holds_on_healthy_engine(tiny_bundle, sc):
    for audit in (False, True):
        report = run_scenario(tiny_bundle, sc, audit=audit)
        assert not report.caught, report.details


@pytest.mark.parametrize("sc", SCENARIOS, ids=IDS)
def test_fault_is_caught_without_audit(tiny_bundle, sc):
    report = run_scenario(tiny_bundle, sc, frozenset([sc.fault]))
    assert report.caught, f"{sc.fault} went unnoticed"
    if sc.fault == "no-scope":
        assert report.caught_by == ["scope"]  # same tokens, same K/V: visible as a cross-tenant hit
    else:
        assert "differential" in report.caught_by  # a wrong output, not only a broken invariant


NOT_CACHE = ("shared-rng", "batch-variant-gemm")  # no block is misused: nothing for the audit to see


@pytest.mark.parametrize("sc", [s for s in SCENARIOS if s.fault not in NOT_CACHE], ids=[f for f in IDS if f not in NOT_CACHE])
def test_audit_names_reader_block_and_writer(tiny_bundle, sc):
    report = run_scenario(tiny_bundle, sc, frozenset([sc.fault]), audit=True)
    assert "audit" in report.caught_by
    msg = next(d for d in report.details if d.startswith("audit:"))
    assert "request" in msg and "block" in msg and "written by" in msg


def test_a_batch_variant_gemm_is_named_by_the_start_up_check(tiny_bundle):
    """The batch-variant GEMM changes outputs (differential) and the engine's own check says why."""
    sc = next(s for s in SCENARIOS if s.fault == "batch-variant-gemm")
    report = run_scenario(tiny_bundle, sc, frozenset([sc.fault]))
    assert {"numerics", "differential"} <= set(report.caught_by), report.details
    assert any("NOT batch-invariant" in d and "split-k" in d for d in report.details)


def test_polluted_request_stays_wrong(tiny_bundle):
    """C11: once a request reads another's K/V, the error propagates to its later tokens."""
    sc = next(s for s in SCENARIOS if s.fault == "write-shared")
    report = run_scenario(tiny_bundle, sc, frozenset([sc.fault]))
    rid, first, wrong, after = max(report.divergence, key=lambda d: d[3])
    assert after >= 3 and wrong == after, report.divergence


@pytest.mark.real
@pytest.mark.parametrize("sc", SCENARIOS, ids=IDS)
def test_fault_is_caught_on_real_model(real_bundle, sc):
    assert not run_scenario(real_bundle, sc).caught
    assert run_scenario(real_bundle, sc, frozenset([sc.fault])).caught
