"""Owns the probe's verdict logic: pure functions over recorded completions -> Verdict(status, evidence).

Knows nothing of HTTP or scenarios' ordering; every rule here can be replayed on a saved report.

Drift or contamination (see /work/shared/ISOLATION.md): two greedy runs of one prompt are compared
up to the first differing token. At that position the reference (the lone or cold run) gave
logprobs to its own token and to its top-k alternatives:

    position   0    1    2    3 (first difference)
    reference  The  cat  sat  on      lp(on) = -0.2, lp(in) = -1.9 in its top-5
    other      The  cat  sat  in      margin = lp(on) - lp(in) = 1.7

A margin above the threshold means the reference was confident, so the other run saw something
else: contamination. A smaller margin is a near tie that numerics can flip: batch variance. When
the other run's token is not in the reference's top-k, the margin is at least lp(ref) - min(top-k).
A canary (a random string from another request's prompt) in an output is contamination whatever
the margins. In exact mode (a server that claims bit-exact results, like isolab) any difference
in tokens or logprobs is contamination.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from isolab.probe.record import Completion


class Status(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"


@dataclass
class Verdict:
    name: str
    status: Status
    summary: str  # one sentence a person reads first
    evidence: list[str] = field(default_factory=list)  # the lines that justify the status
    data: dict[str, Any] = field(default_factory=dict)  # numbers for the JSON report and the plots
    optional: bool = False  # an opt-in check: INCONCLUSIVE here does not spoil the exit code

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "summary": self.summary,
                "evidence": self.evidence, "data": self.data, "optional": self.optional}


@dataclass(frozen=True)
class Thresholds:
    margin: float = 0.5  # nats: a reference this sure of its token cannot be flipped by numerics
    exact: bool = False  # demand bit-identical tokens and logprobs (isolab is batch-invariant)
    cached_slack: int = 2  # tokens a prompt may share with unknown traffic (BOS, a first character)
    alpha: float = 1e-3  # significance for the timing test

    def __post_init__(self) -> None:
        # (written so that NaN fails every test: `nan < 0` is False)
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"--margin must be a finite number of nats, 0 or more, not {self.margin}")
        if not self.cached_slack >= 0 or not 0 < self.alpha < 1:
            raise ValueError("cached_slack must be >= 0 and alpha in (0, 1)")


# -- comparing two greedy runs --------------------------------------------------------------------
@dataclass
class Comparison:
    label: str
    kind: str  # "identical" | "drift" | "contamination" | "undecided"
    position: int | None = None  # first differing token (or character, without logprobs)
    margin: float | None = None  # the reference's preference for its own token there, in nats
    margin_is_bound: bool = False  # the other token was outside the reference's top-k
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def canary_id(canary: str) -> str:
    """The random part of a canary ("zq-canary-kvtbrm" -> "kvtbrm"): what gets searched for."""
    return canary.rsplit("-", 1)[-1]


def foreign_canaries(c: Completion, canaries: Iterable[str]) -> list[str]:
    """Canaries in c's output that were not in c's own prompt."""
    text = c.text.lower()
    return [k for k in canaries if canary_id(k) in text and canary_id(k) not in c.prompt.lower()]


def first_divergence(a: Sequence[str], b: Sequence[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _margin(ref: Completion, other: Completion, pos: int) -> tuple[float | None, bool]:
    if not (ref.has_logprobs and other.tokens is not None and ref.top_logprobs is not None):
        return None, False
    if pos >= len(ref.tokens) or pos >= len(other.tokens) or pos >= len(ref.top_logprobs):  # type: ignore[arg-type]
        return None, False  # one run stopped: an end-of-text choice we have no logprob for
    own = ref.token_logprobs[pos]  # type: ignore[index]
    top = ref.top_logprobs[pos] or {}
    if own is None or not top:
        return None, False
    theirs = top.get(other.tokens[pos])
    if theirs is not None:
        return own - theirs, False
    return own - min(top.values()), True


def _logprob_shift(ref: Completion, other: Completion, upto: int) -> tuple[float, int | None]:
    """The largest |logprob difference| over positions where both runs chose the same token."""
    if not (ref.has_logprobs and other.has_logprobs):
        return 0.0, None
    worst, where = 0.0, None
    for i in range(min(upto, len(ref.token_logprobs), len(other.token_logprobs))):  # type: ignore[arg-type]
        a, b = ref.token_logprobs[i], other.token_logprobs[i]  # type: ignore[index]
        if a is not None and b is not None and abs(a - b) > worst:
            worst, where = abs(a - b), i
    return worst, where


def compare(ref: Completion, other: Completion, *, canaries: Iterable[str] = (), th: Thresholds = Thresholds(),
            label: str = "") -> Comparison:
    """Judge `other` against the reference run of the same prompt (see the module docstring)."""
    if not (ref.ok and other.ok):
        return Comparison(label, "undecided", reason=f"a request failed: {ref.error or other.error}")
    leaked = foreign_canaries(other, canaries)
    a, b = ref.units(), other.units()
    if (ref.tokens is None) != (other.tokens is None):
        a, b = list(ref.text), list(other.text)
    pos = first_divergence(a, b)
    upto = len(a) if pos is None else pos
    shift, shift_at = _logprob_shift(ref, other, upto)
    if leaked:
        return Comparison(label, "contamination", pos, reason=f"another request's canary {leaked[0]!r} in the output")
    if pos is None:
        if shift_at is not None and (shift > th.margin or (th.exact and shift > 0)):
            return Comparison(label, "contamination", shift_at, shift,
                              reason=f"same tokens, but the logprob at token {shift_at} moved by {shift:.3g} nats")
        return Comparison(label, "identical")
    if th.exact:
        return Comparison(label, "contamination", pos, reason=f"tokens differ from position {pos} (exact mode)")
    if shift_at is not None and shift > th.margin:
        return Comparison(label, "contamination", shift_at, shift,
                          reason=f"before the first difference ({pos}) a logprob already moved by {shift:.3g} nats")
    margin, bound = _margin(ref, other, pos)
    if margin is None:
        return Comparison(label, "undecided", pos, reason=f"differs from position {pos}; no logprobs there to tell drift from contamination")
    at_least = "at least " if bound else ""
    if margin > th.margin:
        return Comparison(label, "contamination", pos, margin, bound,
                          reason=f"differs at token {pos} where the reference preferred its token by {at_least}{margin:.3g} nats")
    return Comparison(label, "drift", pos, margin, bound,
                      reason=f"differs at token {pos}, a near tie ({at_least}{margin:.3g} nats): batch variance")


def judge_comparisons(name: str, comps: Sequence[Comparison], what: str) -> Verdict:
    """FAIL on any contamination; INCONCLUSIVE when a difference cannot be judged; else PASS."""
    bad = [c for c in comps if c.kind == "contamination"]
    drift = [c for c in comps if c.kind == "drift"]
    undecided = [c for c in comps if c.kind == "undecided"]
    data = {"comparisons": [c.to_json() for c in comps]}
    evidence = [f"{c.label}: {c.reason}" for c in bad + undecided + drift]
    tail = f"; {len(drift)} near-tie difference(s) reported as batch variance" if drift else ""
    if bad:
        return Verdict(name, Status.FAIL, f"{len(bad)} of {len(comps)} {what} show contamination{tail}", evidence, data)
    if undecided:
        return Verdict(name, Status.INCONCLUSIVE, f"{len(undecided)} of {len(comps)} {what} differ and cannot be judged{tail}",
                       evidence, data)
    if not comps:
        return Verdict(name, Status.INCONCLUSIVE, f"no {what} could be made", evidence, data)
    one = len(comps) == 1  # "1 re-request agrees", not "1 re-requests agree"
    said = f"1 {what.removesuffix('s')} agrees" if one else f"{len(comps)} {what} agree"
    return Verdict(name, Status.PASS, f"{said}{tail}", evidence, data)


# -- cached_tokens ------------------------------------------------------------------------------------
def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading items (characters, token ids) a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cached_excess(c: Completion, earlier_prompts: Iterable[str], slack: int) -> int | None:
    """How far c's cached_tokens exceed what any earlier prompt could have shared; None if within.

    A token lies inside a shared prefix only if all its characters do, so a prompt that shares
    k characters with every prompt before it can share at most k tokens (+ slack for a BOS).
    """
    if c.cached_tokens is None:
        return None
    shared = max((common_prefix_len(c.prompt, p) for p in earlier_prompts if p != c.prompt), default=0)
    if any(p == c.prompt for p in earlier_prompts):
        return None  # the same prompt ran before: any hit is legitimate
    excess = c.cached_tokens - (shared + slack)
    return excess if excess > 0 else None


def judge_cached_bounds(name: str, sequence: Sequence[Completion], th: Thresholds) -> Verdict:
    """In the order sent: no prompt may be served more cached tokens than it shares with earlier ones."""
    if not any(c.cached_tokens is not None for c in sequence):
        return Verdict(name, Status.INCONCLUSIVE, "the server does not report usage.prompt_tokens_details.cached_tokens")
    bad: list[str] = []
    seen: list[str] = []
    for c in sequence:
        excess = cached_excess(c, seen, th.cached_slack)
        if excess is not None:
            shared = c.cached_tokens - excess - th.cached_slack  # type: ignore[operator]
            bad.append(f"{c.prompt[:24]!r}...: cached_tokens={c.cached_tokens} but it shares at most {shared} "
                       f"character(s) with any earlier prompt: a false cache hit")
        seen.append(c.prompt)
    data = {"num_prompts": len(sequence), "num_false_hits": len(bad)}
    if bad:
        return Verdict(name, Status.FAIL, f"{len(bad)} of {len(sequence)} novel prompts were served cached tokens "
                       "they never shared", bad, data)
    return Verdict(name, Status.PASS, f"{len(sequence)} prompts: cached_tokens never exceeded the shared prefix", [], data)


def judge_tenants(owner_cold: Completion, owner_warm: Completion, others: Sequence[Completion], th: Thresholds,
                  *, how: str) -> Verdict:
    """Cross-tenant cached_tokens must be 0, and the same tenant must hit (the positive control)."""
    name = f"tenants ({how})"
    recs = [owner_cold, owner_warm, *others]
    failed = [c for c in recs if not c.ok]
    if failed:
        return Verdict(name, Status.INCONCLUSIVE, f"a request failed: {failed[0].error}")
    if owner_warm.cached_tokens is None:
        return Verdict(name, Status.INCONCLUSIVE, "the server does not report cached_tokens")
    data = {"owner_warm_cached": owner_warm.cached_tokens, "other_cached": [c.cached_tokens for c in others]}
    leaks = [c for c in others if (c.cached_tokens or 0) > 0]
    if leaks:
        return Verdict(name, Status.FAIL, "another tenant was served the owner's cached prefix",
                       [f"tenant {c.tenant}: cached_tokens={c.cached_tokens} for a prompt only tenant "
                        f"{owner_cold.tenant} had sent" for c in leaks], data)
    if owner_warm.cached_tokens <= 0:
        return Verdict(name, Status.INCONCLUSIVE, "no positive control: the owner's own repeat was not served from cache "
                       "(caching off?), so 0 across tenants proves nothing", [], data)
    return Verdict(name, Status.PASS, f"the owner's repeat hit {owner_warm.cached_tokens} cached tokens; the other "
                   "tenant got 0", [], data)


def judge_seeded(alone: Sequence[tuple[Completion, Completion]], loaded: Sequence[Completion], th: Thresholds) -> Verdict:
    """Seeded sampling: each prompt run twice alone (the server must repeat itself), then under load."""
    name = "seeded sampling"
    if any(not c.ok for pair in alone for c in pair) or any(not c.ok for c in loaded):
        return Verdict(name, Status.INCONCLUSIVE, "a seeded request failed")
    unstable = [a for a, b in alone if a.text != b.text]
    if unstable:
        return Verdict(name, Status.FAIL, f"{len(unstable)} of {len(alone)} seeded requests differ even when run alone "
                       "twice: the seed is ignored, or one random stream serves every request (so each request's "
                       "draws depend on the others')", [f"seed {a.seed}: {a.text[:30]!r} vs {b.text[:30]!r}"
                                                        for a, b in alone if a.text != b.text], {"num_unstable": len(unstable)})
    diffs = []
    for (a, _), c in zip(alone, loaded, strict=True):
        pos = first_divergence(a.units(), c.units())
        if pos is not None:
            diffs.append(f"seed {a.seed}: differs under load from token {pos} ({a.text[:30]!r} vs {c.text[:30]!r})")
    data = {"num_prompts": len(loaded), "num_diverged": len(diffs)}
    if diffs and (th.exact or len(diffs) * 2 >= len(loaded)):
        return Verdict(name, Status.FAIL, f"{len(diffs)} of {len(loaded)} seeded requests changed under load", diffs, data)
    if diffs:
        return Verdict(name, Status.PASS, f"{len(diffs)} of {len(loaded)} seeded requests changed under load: too few "
                       "to tell from batch variance", diffs, data)
    return Verdict(name, Status.PASS, f"{len(loaded)} seeded requests gave the same tokens alone and under load", [], data)


def judge_timing(own_hit: Sequence[float], other_hit: Sequence[float], miss: Sequence[float], alpha: float) -> Verdict:
    """Two-sample KS tests on TTFT (Gu et al., ICML 2025): the other tenant's prefix vs a fresh one,
    with the owner's own hits vs a fresh one as the positive control (does timing show hits at all?)."""
    from scipy.stats import ks_2samp

    name = "tenants (timing)"
    if min(len(own_hit), len(other_hit), len(miss)) < 5:
        return Verdict(name, Status.INCONCLUSIVE, "too few TTFT samples", optional=True)

    def test(hit: Sequence[float], label: str) -> dict[str, Any]:
        r = ks_2samp(hit, miss, alternative="greater")  # H1: hits are faster (their CDF lies above)
        med_hit, med_miss = sorted(hit)[len(hit) // 2], sorted(miss)[len(miss) // 2]
        return {"label": label, "p_value": float(r.pvalue), "ks_statistic": float(r.statistic),
                "median_hit_ms": med_hit * 1e3, "median_miss_ms": med_miss * 1e3,
                "median_diff_ms": (med_miss - med_hit) * 1e3, "n_hit": len(hit), "n_miss": len(miss)}

    own, other = test(own_hit, "same tenant"), test(other_hit, "other tenant")
    data = {"own": own, "other": other, "alpha": alpha}
    ev = [f"{d['label']} vs never cached: KS D={d['ks_statistic']:.3f}, p={d['p_value']:.2g}, median TTFT "
          f"{d['median_hit_ms']:.1f} ms vs {d['median_miss_ms']:.1f} ms" for d in (own, other)]
    if other["p_value"] < alpha:
        return Verdict(name, Status.FAIL, "a prefix cached by another tenant answers measurably faster: a timing "
                       "side channel", ev, data, optional=True)
    if own["p_value"] >= alpha:
        return Verdict(name, Status.INCONCLUSIVE, "timing cannot tell even the tenant's own cache hits from misses, so "
                       "the cross-tenant test has no power", ev, data, optional=True)
    return Verdict(name, Status.PASS, "own hits are measurably faster, another tenant's are not", ev, data, optional=True)


def judge_monitoring(responses: Sequence[tuple[str, int, str]], secrets: Iterable[str]) -> Verdict:
    """Unauthenticated GETs (path, status, body): no body may contain a canary or prompt text."""
    name = "monitoring"
    needles = [s.lower() for s in secrets if s]
    bad = []
    for path, status, body in responses:
        low = body.lower()
        hit = next((s for s in needles if s in low), None)
        if hit is not None:
            bad.append(f"GET {path} -> {status} contains prompt text {hit[:40]!r}")
    open_paths = list(dict.fromkeys(p for p, s, _ in responses if s == 200))  # (each path is fetched twice)
    paths = len({p for p, _, _ in responses})
    data = {"paths": [{"path": p, "status": s, "bytes": len(b)} for p, s, b in responses]}
    if bad:
        return Verdict(name, Status.FAIL, f"{len(bad)} unauthenticated endpoint(s) show prompt text", bad, data)
    return Verdict(name, Status.PASS, f"{paths} paths fetched {len(responses) // max(paths, 1)} times ({len(open_paths)} "
                   f"answered 200: {', '.join(open_paths) or 'none'}); no prompt text", [], data)


def combine(name: str, parts: Sequence[Verdict]) -> Verdict:
    """A scenario's verdict from its checks: any FAIL fails it; a required INCONCLUSIVE makes it inconclusive."""
    if any(p.status is Status.FAIL for p in parts):
        status = Status.FAIL
    elif any(p.status is Status.INCONCLUSIVE and not p.optional for p in parts):
        status = Status.INCONCLUSIVE
    else:
        status = Status.PASS
    lead = [p for p in parts if p.status is status and not (status is Status.PASS and p.optional and p.status is not Status.PASS)]
    summary = "; ".join(f"{p.name}: {p.summary}" for p in (lead or parts)[:3])
    return Verdict(name, status, summary, [f"[{p.status.value}] {p.name}: {p.summary}" for p in parts],
                   {"checks": [p.to_json() for p in parts]})
