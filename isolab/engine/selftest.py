"""Owns the fault catalogue's scenarios: for each fault, a workload that exposes it, and the
checks that must catch it (and must stay silent on a healthy engine).

Checks:
  differential  a request's tokens or logprobs differ (bit for bit) from the same request run
                alone on a clean engine
  scope         a request was served cached tokens that only another scope ever computed
  invariants    the block pool's invariant checker fails after a step (white-box)
  audit         audit mode raised an IsolationViolation (writer tags, scope, tokens, checksum)
  numerics      the engine's start-up check found its numerics not batch-invariant on this CPU
                (models/invariance.py), so batched and solo runs may differ without any sharing
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from isolab.engine.hashing import ExtraKeys, block_key, weak
from isolab.faults import FAULTS
from isolab.models.bundle import ModelBundle
from isolab.sampling_params import SamplingParams
from isolab.testing.workload import Arrival, Finished, drive, make_engine, run_alone

BS = 16


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # the fault it is built to expose
    what: str
    kv_blocks: int
    build: Callable[[ModelBundle, random.Random, str], list[Arrival]]  # (bundle, rng, the pool's kv_cache_dtype)


@dataclass
class Report:
    scenario: str
    faults: tuple[str, ...]
    audit: bool
    caught_by: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    # C11: where the first wrong token appeared and how many of the later ones were wrong too
    divergence: list[tuple[str, int, int, int]] = field(default_factory=list)  # (rid, first, wrong, total)

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def _tokens(rng: random.Random, bundle: ModelBundle, n: int) -> tuple[int, ...]:
    lo = min(100, bundle.hparams.vocab_size // 4)
    return tuple(rng.randrange(lo, bundle.hparams.vocab_size) for _ in range(n))


def _reuse(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    # A's first block is cached; B2 evicts and rewrites it (unsealed) while A' asks for it again.
    a = _tokens(rng, b, 24)
    return [
        Arrival(0, "A", a, _greedy(4)),
        Arrival(6, "B1", _tokens(rng, b, 20), _greedy(1)),
        Arrival(6, "B2", _tokens(rng, b, 4), _greedy(30)),
        Arrival(8, "A2", a, _greedy(6)),
    ]


def _coarse(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    # Two different prompts of equal length, one after the other.
    return [Arrival(0, "X", _tokens(rng, b, 24), _greedy(6)), Arrival(8, "Y", _tokens(rng, b, 24), _greedy(6))]


def _weak(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    # Y's first block differs from X's but its 8-bit key collides (found by search: 1 in 256), under
    # the key the engine computes (its pool's dtype is part of it).
    extra = ExtraKeys(b.fingerprint, b.cache_numerics_key(kv), None)
    x = _tokens(rng, b, 24)
    target = weak(block_key(None, x[:BS], extra))
    while True:
        y = _tokens(rng, b, 24)
        if y[:BS] != x[:BS] and weak(block_key(None, y[:BS], extra)) == target:
            break
    return [Arrival(0, "X", x, _greedy(6)), Arrival(8, "Y", y, _greedy(6))]


def _scope(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    p = _tokens(rng, b, 40)
    return [Arrival(0, "tenantA", p, _greedy(4), scope="A"), Arrival(6, "tenantB", p, _greedy(4), scope="B")]


def _write_shared(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    # Y extends X's prompt while X decodes: only X's sealed blocks may be shared, never its tail.
    p = _tokens(rng, b, 40)
    return [Arrival(0, "X", p, _greedy(12)), Arrival(1, "Y", p + _tokens(rng, b, 10), _greedy(4))]


def _rng(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    mk = lambda seed: SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0)  # noqa: E731
    return [Arrival(0, "S1", _tokens(rng, b, 12), mk(1)), Arrival(0, "S2", _tokens(rng, b, 12), mk(2))]


def _wide(b: ModelBundle, rng: random.Random, kv: str = "auto") -> list[Arrival]:
    # Ten requests decoding side by side: steps of 10 rows, where a batch-variant GEMM changes order.
    return [Arrival(0, f"R{i}", _tokens(rng, b, 5 + i), _greedy(6)) for i in range(10)]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("evict-and-rehit", "reuse-without-invalidate", "a cached block is evicted and rewritten while its old prefix is asked for again", 3, _reuse),
    Scenario("equal-length-prompts", "coarse-key", "two different prompts of the same length, one after the other", 16, _coarse),
    Scenario("colliding-8-bit-keys", "weak-hash", "a prompt whose first block's 8-bit key collides with a cached one", 16, _weak),
    Scenario("two-tenants-one-prefix", "no-scope", "two tenants send the same 40-token prompt", 16, _scope),
    Scenario("extend-a-running-prompt", "write-shared", "a prompt that extends another request's prompt while it decodes", 16, _write_shared),
    Scenario("two-seeded-samplers", "shared-rng", "two seeded sampling requests run together", 16, _rng),
    Scenario("ten-rows-a-step", "batch-variant-gemm", "ten requests decode together, ten rows in every GEMM", 24, _wide),
)
assert {s.fault for s in SCENARIOS} == set(FAULTS)


# (bundle, scenario, seed, pool dtype) -> the solo runs; the bundle is kept so that its id is not reused.
_REFERENCES: dict[tuple[int, str, int, str], tuple[ModelBundle, dict[str, Finished]]] = {}


def reference(bundle: ModelBundle, sc: Scenario, seed: int = 0, kv_cache_dtype: str = "auto") -> dict[str, Finished]:
    """Each of the scenario's requests alone, one after another, on a healthy engine without a prefix
    cache (its pool of the same dtype). It depends on neither the faults nor audit mode of the run it
    checks, so it is computed once per bundle, scenario, seed and pool dtype, and shared by the
    healthy, faulty and audit runs."""
    key = (id(bundle), sc.name, seed, kv_cache_dtype)
    hit = _REFERENCES.get(key)
    if hit is None or hit[0] is not bundle:
        if len(_REFERENCES) >= 8 * len(SCENARIOS):
            _REFERENCES.clear()
        ref = make_engine(bundle, 64, prefix=False, kv_cache_dtype=kv_cache_dtype)
        hit = _REFERENCES[key] = (bundle, run_alone(ref, sc.build(bundle, random.Random(seed), kv_cache_dtype)))
        ref.close()
    return hit[1]


def run_scenario(bundle: ModelBundle, sc: Scenario, faults: frozenset[str] = frozenset(), *, audit: bool = False,
                 seed: int = 0, kv_cache_dtype: str = "auto") -> Report:
    arrivals = sc.build(bundle, random.Random(seed), kv_cache_dtype)
    report = Report(sc.name, tuple(sorted(faults)), audit)
    eng = make_engine(bundle, sc.kv_blocks, faults=faults, audit=audit, kv_cache_dtype=kv_cache_dtype)
    run = drive(eng, arrivals, check_invariants=True)
    ok = {rid: f for rid, f in run.finished.items() if f.error is None}  # the others were aborted by audit
    tokens = {rid: f.pairs() for rid, f in ok.items()}  # tokens and their logprobs, bit for bit
    cached = {rid: f.num_cached_tokens for rid, f in ok.items()}
    found = [(f.step, 0, f"audit: {f.error}") for f in run.finished.values() if f.error is not None]
    if run.invariant_breach is not None:  # checked after the step's outputs
        step, msg = run.invariant_breach
        found.append((step, 1, f"invariants: step {step}: {msg}"))
    problems = [p for _, _, p in sorted(found, key=lambda f: f[:2])]  # in the order they happened
    if not eng.numerics.invariant:
        problems.append(f"numerics: {eng.numerics.summary()}")
    for p in problems:
        kind = p.split(":", 1)[0]
        if kind not in report.caught_by:
            report.caught_by.append(kind)
        report.details.append(p)
    # Reference: each request alone on a clean engine without a prefix cache.
    alone = reference(bundle, sc, seed, kv_cache_dtype)
    for a in arrivals:
        if a.rid not in tokens:
            continue  # aborted by audit
        got, want = tokens[a.rid], alone[a.rid].pairs()
        if got != want:
            first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
            wrong = sum(1 for g, w in zip(got[first:], want[first:], strict=False) if g != w)
            report.divergence.append((a.rid, first, wrong, len(want) - first))
            if "differential" not in report.caught_by:
                report.caught_by.append("differential")
            what = "tokens" if [t for t, _ in got] != [t for t, _ in want] else "logprobs only"
            report.details.append(f"differential: {a.rid} differs from its solo run from token {first} on ({what})")
    # Cross-scope hits: a request served cached tokens that only another scope computed.
    first_scope: dict[tuple[int, ...], str | None] = {}
    for a in sorted(arrivals, key=lambda a: a.step):
        prefix = a.prompt[:BS]
        owner = first_scope.setdefault(prefix, a.scope)
        if owner != a.scope and cached.get(a.rid, 0) > 0 and not any(
            b.prompt[:BS] == prefix and b.scope == a.scope and b.step < a.step for b in arrivals
        ):
            report.caught_by.append("scope")
            report.details.append(f"scope: {a.rid} (scope {a.scope}) got {cached[a.rid]} cached tokens computed by scope {owner}")
    eng.close()
    return report
