"""The probe's verdict logic on recorded responses (no server): drift vs contamination, the
cached_tokens bound, tenants with their positive control, seeds, timing, monitoring, exit codes."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from isolab.probe.record import Completion
from isolab.probe.runner import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, ProbeResult
from isolab.probe.verdicts import (
    Status,
    Thresholds,
    Verdict,
    cached_excess,
    combine,
    compare,
    first_divergence,
    judge_cached_bounds,
    judge_comparisons,
    judge_monitoring,
    judge_seeded,
    judge_tenants,
    judge_timing,
)

DATA = json.loads((Path(__file__).parent / "data" / "recorded_pair.json").read_text())


def recorded() -> tuple[Completion, Completion]:
    return Completion.from_json(DATA["alone"]), Completion.from_json(DATA["loaded"])


def greedy(tokens: list[str], lps: list[float], tops: list[dict[str, float]], prompt: str = "p") -> Completion:
    return Completion(prompt, "".join(tokens), tokens, lps, tops)


def test_recorded_pair_round_trips_and_agrees():
    alone, loaded = recorded()
    assert Completion.from_json(json.loads(json.dumps(alone.to_json()))) == alone
    assert compare(alone, loaded).kind == "identical"
    assert compare(alone, loaded, th=Thresholds(exact=True)).kind == "identical"  # isolab: bit-exact under load


def test_a_confident_divergence_is_contamination():
    alone, loaded = recorded()
    # position 0: the lone run gave ' z' -1.41 and ' the' -2.91: margin 1.5 nats
    loaded.tokens[0] = " the"
    c = compare(alone, loaded)
    assert (c.kind, c.position, c.margin_is_bound) == ("contamination", 0, False)
    assert c.margin == pytest.approx(1.5)


def test_a_near_tie_is_batch_variance():
    ref = greedy(["a", "b"], [-0.70, -0.1], [{"a": -0.70, "c": -0.72}, {"b": -0.1}])
    other = greedy(["a", "c"], [-0.70, -0.3], [{"a": -0.70, "c": -0.72}, {"c": -0.3}])
    other.tokens, other.token_logprobs = ["c", "x"], [-0.72, -0.3]
    c = compare(ref, other)
    assert (c.kind, c.position) == ("drift", 0) and c.margin == pytest.approx(0.02)
    v = judge_comparisons("x", [c], "runs")
    assert v.status is Status.PASS and "batch variance" in v.summary
    assert compare(ref, other, th=Thresholds(exact=True)).kind == "contamination"


def test_a_token_outside_the_top_k_gives_a_lower_bound():
    ref = greedy(["a"], [-0.1], [{"a": -0.1, "b": -0.4}])
    other = greedy(["zzz"], [-3.0], [{"zzz": -3.0}])
    c = compare(ref, other)
    assert c.margin_is_bound and c.margin == pytest.approx(0.3) and c.kind == "drift"
    assert compare(ref, other, th=Thresholds(margin=0.2)).kind == "contamination"


def test_without_logprobs_a_difference_is_undecided():
    a, b = Completion("p", "hello world"), Completion("p", "hello there")
    c = compare(a, b)
    assert (c.kind, c.position) == ("undecided", 6)
    assert judge_comparisons("x", [c], "runs").status is Status.INCONCLUSIVE
    assert compare(a, Completion("p", "hello world")).kind == "identical"


def test_a_foreign_canary_is_contamination_but_the_own_one_is_not():
    alone, loaded = recorded()
    own = "zq-canary-mclkgj"
    assert own in loaded.text and compare(alone, loaded, canaries=[own]).kind == "identical"
    loaded.text += " zq-canary-bbbbbb"
    c = compare(alone, loaded, canaries=[own, "zq-canary-bbbbbb"])
    assert c.kind == "contamination" and "bbbbbb" in c.reason


def test_a_logprob_shift_with_equal_tokens_is_contamination():
    alone, loaded = recorded()
    loaded.token_logprobs[3] -= 2.0  # same tokens, but the model saw another context
    c = compare(alone, loaded)
    assert (c.kind, c.position) == ("contamination", 3)


def test_first_divergence():
    assert first_divergence("abc", "abc") is None
    assert first_divergence("abc", "abd") == 2
    assert first_divergence("ab", "abc") == 2


def test_cached_tokens_bound():
    earlier = ["kvtbrm notes. The access code", "qqq"]
    novel = Completion("zzxxyy notes.", cached_tokens=16)
    assert cached_excess(novel, earlier, slack=2) == 14  # shares 0 characters: at most 2 tokens
    shares = Completion("kvtbrm notes. Other", cached_tokens=12)
    assert cached_excess(shares, earlier, slack=2) is None  # shares 14 characters
    repeat = Completion("qqq", cached_tokens=99)
    assert cached_excess(repeat, earlier, slack=2) is None
    seq = [Completion("aaaa", cached_tokens=0), Completion("bbbb", cached_tokens=0), Completion("cccc", cached_tokens=16)]
    v = judge_cached_bounds("b", seq, Thresholds())
    assert v.status is Status.FAIL and v.data["num_false_hits"] == 1
    assert judge_cached_bounds("b", seq[:2], Thresholds()).status is Status.PASS
    assert judge_cached_bounds("b", [Completion("x")], Thresholds()).status is Status.INCONCLUSIVE


def _t(tenant: str, cached: int | None) -> Completion:
    return Completion("p", "out", cached_tokens=cached, tenant=tenant)


def test_tenants_need_the_positive_control():
    th = Thresholds()
    assert judge_tenants(_t("A", 0), _t("A", 32), [_t("B", 0)], th, how="keys").status is Status.PASS
    assert judge_tenants(_t("A", 0), _t("A", 32), [_t("B", 32)], th, how="keys").status is Status.FAIL
    # caching off: 0 across tenants proves nothing
    assert judge_tenants(_t("A", 0), _t("A", 0), [_t("B", 0)], th, how="keys").status is Status.INCONCLUSIVE
    assert judge_tenants(_t("A", None), _t("A", None), [_t("B", None)], th, how="keys").status is Status.INCONCLUSIVE


def _s(text: str, seed: int = 1) -> Completion:
    return Completion("p", text, seed=seed, temperature=1.0)


def test_seeded_sampling():
    th = Thresholds()
    alone = [(_s("abc", 1), _s("abc", 1)), (_s("def", 2), _s("def", 2)), (_s("ghi", 3), _s("ghi", 3))]
    assert judge_seeded(alone, [_s("abc"), _s("def"), _s("ghi")], th).status is Status.PASS
    one = judge_seeded(alone, [_s("abX"), _s("def"), _s("ghi")], th)
    assert one.status is Status.PASS and one.data["num_diverged"] == 1  # too few to tell from drift
    assert judge_seeded(alone, [_s("abX"), _s("dXf"), _s("ghi")], th).status is Status.FAIL
    assert judge_seeded(alone, [_s("abX"), _s("def"), _s("ghi")], Thresholds(exact=True)).status is Status.FAIL
    # a shared generator: not even reproducible alone
    assert judge_seeded([(_s("abc"), _s("xyz"))], [_s("abc")], th).status is Status.FAIL


def test_timing_ks_with_positive_control():
    rng = random.Random(0)
    fast = [rng.gauss(0.02, 0.002) for _ in range(60)]
    slow = [rng.gauss(0.05, 0.002) for _ in range(60)]
    slow2 = [rng.gauss(0.05, 0.002) for _ in range(60)]
    v = judge_timing(fast, slow2, slow, alpha=1e-3)
    assert v.status is Status.PASS and v.optional and v.data["other"]["p_value"] > 1e-3
    leak = judge_timing(fast, fast, slow, alpha=1e-3)
    assert leak.status is Status.FAIL and leak.data["other"]["median_diff_ms"] == pytest.approx(30, abs=3)
    blind = judge_timing(slow2, slow2, slow, alpha=1e-3)
    assert blind.status is Status.INCONCLUSIVE


def test_monitoring():
    secrets = ["zq-canary-kvtbrm", "Kvtbrm notes. The access code is"]
    ok = judge_monitoring([("/metrics", 200, "isolab_steps 3"), ("/slots", 404, "not found")] * 2, secrets)
    assert ok.status is Status.PASS
    assert "2 paths fetched 2 times (1 answered 200: /metrics)" in ok.summary  # each path named once
    bad = judge_monitoring([("/slots", 200, '[{"prompt": "... zq-canary-kvtbrm ..."}]')], secrets)
    assert bad.status is Status.FAIL and "/slots" in bad.evidence[0]


def test_combine_and_exit_codes():
    p, f = Verdict("a", Status.PASS, "ok"), Verdict("b", Status.FAIL, "bad")
    i, opt = Verdict("c", Status.INCONCLUSIVE, "?"), Verdict("d", Status.INCONCLUSIVE, "?", optional=True)
    assert combine("s", [p, opt]).status is Status.PASS
    assert combine("s", [p, i]).status is Status.INCONCLUSIVE
    assert combine("s", [i, f]).status is Status.FAIL

    def result(*vs: Verdict) -> ProbeResult:
        return ProbeResult("u", "m", "t", 0.0, list(vs), [], [], {}, {})

    assert result(combine("s", [p, opt])).exit_code == EXIT_PASS
    assert result(combine("s", [p, i])).exit_code == EXIT_INCONCLUSIVE
    assert result(combine("s", [p]), combine("t", [f])).exit_code == EXIT_FAIL


def test_records_do_not_share_lists_with_their_json():
    before = copy.deepcopy(DATA)
    alone, _ = recorded()
    alone.tokens[0] = "changed"
    assert DATA == before


def test_the_table_says_each_sentence_once_and_shows_opt_in_checks():
    """A failed check was printed twice (the summary, then its [FAIL] line); a passing opt-in timing
    test was not printed at all (only report.md had it)."""
    from io import StringIO

    from rich.console import Console

    from isolab.probe.report import print_summary
    from isolab.probe.verdicts import Status, Verdict, combine

    bad = combine("reuse", [Verdict("sequential reuse", Status.PASS, "3 runs agree"),
                            Verdict("evict and re-hit", Status.FAIL, "1 of 3 re-requests show contamination")])
    tenants = combine("tenants", [Verdict(f"tenants (api keys) {i}", Status.PASS, "the other tenant got 0") for i in range(3)]
                      + [Verdict("tenants (timing)", Status.PASS, "own hits are measurably faster", optional=True)])
    out = StringIO()
    print_summary(ProbeResult("http://x/v1", "m", "now", 1.0, [bad, tenants], [], [], {}, {}),
                  Console(file=out, width=400))
    text = out.getvalue()
    assert text.count("1 of 3 re-requests show contamination") == 1, text
    assert "own hits are measurably faster" in text
