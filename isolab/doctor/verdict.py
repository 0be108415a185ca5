"""Owns the doctor's judgement: the seed's four questions answered from recorded runs, and the verdict.

Pure: takes the runs' symptoms (experiments.py records them), returns answers and a verdict, so
tests check it on recorded results without a model.

    (a) concurrency  symptoms when requests share an engine, none when each runs alone
    (b) input        the symptomatic requests change when the content changes (same shapes)
    (c) load         the symptom rate grows with concurrency
    (d) cache        the symptoms vanish with the prefix cache off

Verdict (the seed: yes to (a) and (d) locks it on shared state or cache isolation):
    no symptom anywhere                               -> NO_SYMPTOM
    ... but the cache served no token in the sweep    -> UNEXERCISED (inconclusive, as the probe says it)
    a symptom alone (no sharing at all)               -> SOMETHING_ELSE
    shared-engine symptoms that vanish with cache off -> CACHE_ISOLATION
    shared-engine symptoms that persist with it off   -> SHARED_NOT_CACHE
    shared-engine symptoms, no way to turn cache off  -> SHARED_STATE
and before those, from the target's own start-up check (models/invariance.py), where it has one:
    shared-engine symptoms that persist with the cache off (or no switch), on an engine whose
    numerics are not batch-invariant on this CPU    -> NUMERICS (not isolation: a row's bits
                                                       depend on the batch, so batched and alone differ)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from isolab.doctor.symptoms import Symptom, symptomatic_ids

NO_SYMPTOM = "no symptom"
SOMETHING_ELSE = "something else (not isolation)"
CACHE_ISOLATION = "shared state: cache isolation"
SHARED_NOT_CACHE = "shared state, not the cache (e.g. RNG or batch state)"
SHARED_STATE = "shared state (cache or not: no cache switch to tell)"
UNEXERCISED = ("no symptom seen, but the prefix cache served no tokens (or the server does not report them): "
               "a cache fault could not have shown (inconclusive)")
NUMERICS = "the engine's numerics are not batch-invariant on this CPU (not shared state, not the cache)"

YES, NO, NA = "yes", "no", "n/a"


@dataclass
class RunRecord:
    label: str
    content: str  # "original" | "variant"
    concurrency: int | None  # None: each request alone
    prefix_cache: bool
    num_items: int
    symptoms: list[Symptom]
    stats: dict = field(default_factory=dict)  # engine counters (hits, evictions, violations)

    @property
    def num_symptomatic(self) -> int:
        return len(symptomatic_ids(self.symptoms))

    @property
    def rate(self) -> float:
        return self.num_symptomatic / self.num_items if self.num_items else 0.0


@dataclass
class Findings:
    target: str
    alone: RunRecord
    sweep: list[RunRecord]  # together, original content, cache on, by rising concurrency
    variant: RunRecord  # together at the top concurrency, other content
    nocache: list[RunRecord]  # together, cache off (empty: the target has no switch)
    warnings: list[str] = field(default_factory=list)  # why a "no" may be vacuous
    numerics: str | None = None  # the target's numerics path, where it reports one
    batch_invariant: bool | None = None  # its start-up check's verdict; None: not reported


@dataclass(frozen=True)
class Answer:
    question: str
    answer: str  # yes | no | n/a
    evidence: str


@dataclass(frozen=True)
class Verdict:
    verdict: str
    answers: tuple[Answer, ...]

    @property
    def fired(self) -> list[str]:
        return [a.question[1] for a in self.answers if a.answer == YES]


def _ids(runs: Sequence[RunRecord]) -> set[str]:
    return set().union(*(symptomatic_ids(r.symptoms) for r in runs)) if runs else set()


def answer_concurrency(f: Findings) -> Answer:
    shared = [r for r in f.sweep if r.symptoms]
    n_alone = f.alone.num_symptomatic
    ev = (f"alone: {n_alone}/{f.alone.num_items} requests; sharing an engine: "
          + ", ".join(f"c={r.concurrency}: {r.num_symptomatic}" for r in f.sweep))
    return Answer("(a) only under concurrency or batching, never alone?", YES if shared and not n_alone else NO, ev)


def _names(ids: set[str], most: int = 8) -> str:
    """'r01, r04, r07' (at most `most` named, then how many more), or 'none'."""
    names = sorted(ids)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more if names else "none"


def answer_input(f: Findings) -> Answer:
    top = f.sweep[-1] if f.sweep else None
    orig = symptomatic_ids(top.symptoms) if top else set()
    var = symptomatic_ids(f.variant.symptoms)
    ev = f"original content: {_names(orig)}; same shapes, other content: {_names(var)}"
    if not orig and not var:
        return Answer("(b) depends on the input (same lengths, other content)?", NA, ev)
    overlap = len(orig & var) / len(orig | var)
    ev += f" (overlap {overlap:.0%})"
    return Answer("(b) depends on the input (same lengths, other content)?", YES if overlap < 0.5 else NO, ev)


def answer_load(f: Findings) -> Answer:
    rates = [(r.concurrency, r.rate) for r in f.sweep]
    ev = ", ".join(f"c={c}: {rate:.0%}" for c, rate in rates)
    if not any(rate for _, rate in rates):
        return Answer("(c) grows with load?", NA, ev)
    ups = sum(1 for (_, a), (_, b) in zip(rates, rates[1:], strict=False) if b > a)
    downs = sum(1 for (_, a), (_, b) in zip(rates, rates[1:], strict=False) if b < a)
    grows = rates[-1][1] > rates[0][1] and ups >= downs
    return Answer("(c) grows with load?", YES if grows else NO, ev)


def served_from_cache(runs: Sequence[RunRecord]) -> int:
    """Prompt tokens the runs report as served from the prefix cache (0 where none report it)."""
    return sum(int(r.stats.get("prefix_cache_hits_tokens", r.stats.get("cached_tokens")) or 0) for r in runs)


def cache_unexercised(sweep: Sequence[RunRecord]) -> bool:
    """Whether every sweep run reports a cache that served no token: no cache fault could have shown."""
    hits = [r.stats.get("prefix_cache_hits_tokens", r.stats.get("cached_tokens")) for r in sweep]
    return bool(hits) and all(h == 0 for h in hits)


def cache_switched_off(f: Findings) -> bool:
    """Whether the cache-off runs ran with the cache off: not where they were still served cached
    tokens (a --no-cache-field the server ignores, e.g. llama.cpp's cache_prompt sent to isolab)."""
    return bool(f.nocache) and served_from_cache(f.nocache) == 0


def answer_cache(f: Findings) -> Answer:
    if not f.nocache:
        return Answer("(d) vanishes with prefix caching off?", NA, "no way to turn the cache off was given")
    if not cache_switched_off(f):
        return Answer("(d) vanishes with prefix caching off?", NA,
                      f"the cache was not off: the runs meant to be without it were served "
                      f"{served_from_cache(f.nocache)} cached tokens (the server ignores that field)")
    on = {r.concurrency: r.num_symptomatic for r in f.sweep}
    ev = ", ".join(f"c={r.concurrency}: {on.get(r.concurrency, '?')} with cache, {r.num_symptomatic} without" for r in f.nocache)
    if not any(on.values()) and not any(r.symptoms for r in f.nocache):
        return Answer("(d) vanishes with prefix caching off?", NA, ev)
    return Answer("(d) vanishes with prefix caching off?", NO if any(r.symptoms for r in f.nocache) else YES, ev)


def judge(f: Findings) -> Verdict:
    answers = (answer_concurrency(f), answer_input(f), answer_load(f), answer_cache(f))
    # a foreign hit seen one request at a time is cross-request state (a server's cache outlives each
    # request): a sign of sharing, not of something else
    foreign_alone = [s for s in f.alone.symptoms if s.kind == "foreign-hit"]
    shared = _ids(f.sweep) | symptomatic_ids(f.variant.symptoms) | _ids(f.nocache) | symptomatic_ids(foreign_alone)
    if len(foreign_alone) < len(f.alone.symptoms):
        v = SOMETHING_ELSE
    elif not shared:
        v = UNEXERCISED if cache_unexercised(f.sweep) else NO_SYMPTOM
    elif f.batch_invariant is False and (not cache_switched_off(f) or any(r.symptoms for r in f.nocache)):
        v = NUMERICS
    elif not cache_switched_off(f):
        v = SHARED_STATE
    elif any(r.symptoms for r in f.nocache):
        v = SHARED_NOT_CACHE
    else:
        v = CACHE_ISOLATION
    return Verdict(v, answers)


def to_json(f: Findings, v: Verdict) -> dict:
    def run(r: RunRecord) -> dict:
        d = asdict(r)
        d["num_symptomatic"] = r.num_symptomatic
        d["rate"] = r.rate
        return d

    return {
        "target": f.target,
        "verdict": v.verdict,
        "fired": v.fired,
        "answers": [asdict(a) for a in v.answers],
        "warnings": f.warnings,
        "numerics": f.numerics,
        "batch_invariant": f.batch_invariant,
        "runs": {"alone": run(f.alone), "sweep": [run(r) for r in f.sweep], "variant": run(f.variant),
                 "nocache": [run(r) for r in f.nocache]},
    }
