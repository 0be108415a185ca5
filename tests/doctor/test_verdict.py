"""The verdict logic on recorded results: each attribution, and each question's answer."""

from __future__ import annotations

from isolab.doctor.symptoms import Symptom
from isolab.doctor.verdict import (
    CACHE_ISOLATION,
    NA,
    NO,
    NO_SYMPTOM,
    SHARED_NOT_CACHE,
    SHARED_STATE,
    SOMETHING_ELSE,
    Findings,
    RunRecord,
    judge,
)

N = 10


def run(label: str, c: int | None, ids: list[str] = (), cache: bool = True, content: str = "original") -> RunRecord:
    return RunRecord(label, content, c, cache, N, [Symptom(i, "differs", "x") for i in ids])


def findings(sweep: dict[int, list[str]], nocache: dict[int, list[str]] | None, variant: list[str] = (), alone: list[str] = ()) -> Findings:
    return Findings(
        "recorded",
        run("alone", None, alone),
        [run(f"c={c}", c, ids) for c, ids in sorted(sweep.items())],
        run("variant", max(sweep), variant, content="variant"),
        [run(f"off c={c}", c, ids, cache=False) for c, ids in sorted((nocache or {}).items())] if nocache is not None else [],
    )


def test_healthy_is_no_symptom():
    v = judge(findings({1: [], 4: [], 16: []}, {16: []}))
    assert v.verdict == NO_SYMPTOM and v.fired == []
    assert [a.answer for a in v.answers] == [NO, NA, NA, NA]


def test_cache_fault_is_cache_isolation():
    v = judge(findings({1: [], 4: ["r1"], 16: ["r1", "r2"]}, {4: [], 16: []}, variant=["r1", "r2"]))
    assert v.verdict == CACHE_ISOLATION
    assert v.fired == ["a", "c", "d"]  # same shapes, same victims: (b) does not fire


def test_content_dependent_cache_fault_fires_b():
    v = judge(findings({1: ["r3"], 16: ["r3"]}, {1: [], 16: []}, variant=["r7"]))
    assert v.verdict == CACHE_ISOLATION
    assert "b" in v.fired and "c" not in v.fired  # flat with load


def test_shared_rng_is_shared_state_not_cache():
    v = judge(findings({1: [], 2: ["s1", "s2"], 16: ["s1", "s2", "s3"]}, {2: ["s1"], 16: ["s1", "s2"]}, variant=["s1", "s2"]))
    assert v.verdict == SHARED_NOT_CACHE
    assert v.fired == ["a", "c"]


def test_symptom_alone_is_something_else():
    v = judge(findings({1: ["r1"], 16: ["r1"]}, {1: ["r1"], 16: ["r1"]}, variant=["r1"], alone=["r1"]))
    assert v.verdict == SOMETHING_ELSE
    assert "a" not in v.fired


def test_no_cache_switch_leaves_the_cache_question_open():
    v = judge(findings({1: [], 16: ["r1"]}, None, variant=["r1"]))
    assert v.verdict == SHARED_STATE
    assert v.answers[3].answer == NA


def test_a_cache_switch_the_server_ignores_leaves_the_question_open():
    """A --no-cache-field the server ignores (llama.cpp's cache_prompt sent to isolab) came back with
    cached tokens: those runs had the cache on, so (d) is not asked and the symptoms that persisted
    there do not read as "not the cache"."""
    f = findings({1: [], 16: ["r1"]}, {16: ["r1"]}, variant=["r1"])
    f.nocache[0].stats["cached_tokens"] = 448
    v = judge(f)
    assert v.answers[3].answer == NA and "448 cached tokens" in v.answers[3].evidence
    assert v.verdict == SHARED_STATE
    f.nocache[0].stats["cached_tokens"] = 0  # the switch worked: symptoms that persist are not the cache
    assert judge(f).verdict == SHARED_NOT_CACHE


def test_decreasing_rate_does_not_grow_with_load():
    v = judge(findings({1: ["a", "b"], 4: ["a"], 16: []}, {1: [], 4: []}))
    assert v.answers[2].answer == NO
    assert v.verdict == CACHE_ISOLATION


def test_a_cache_that_never_hit_is_flagged():
    from isolab.doctor.experiments import vacuity_warnings

    cold = [RunRecord("c=1", "original", 1, True, N, [], {"prefix_cache_hits_tokens": 0})]
    warm = [RunRecord("c=1", "original", 1, True, N, [], {"prefix_cache_hits_tokens": 32})]
    assert vacuity_warnings(cold) and not vacuity_warnings(warm)


def test_no_symptom_from_a_cache_that_never_hit_is_inconclusive():
    """As the probe says INCONCLUSIVE where a server reports no cached tokens: the doctor does not
    answer "no symptom" (exit 0) from runs that could not have shown a cache fault."""
    from isolab.doctor.verdict import UNEXERCISED

    f = findings({1: [], 4: []}, {4: []})
    for r in f.sweep:
        r.stats["cached_tokens"] = 0
    assert judge(f).verdict == UNEXERCISED
    f.sweep[-1].stats["cached_tokens"] = 64  # one run was served from the cache: a fault could have shown
    assert judge(f).verdict == NO_SYMPTOM
