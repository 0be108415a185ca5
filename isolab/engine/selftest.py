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

from isolab.config import CacheConfig, EngineConfig, SchedulerConfig
from isolab.engine.faults import FAULTS
from isolab.engine.hashing import ExtraKeys, block_key, weak
from isolab.engine.kv_storage import bytes_per_block
from isolab.engine.llm_engine import LLMEngine
from isolab.models.bundle import ModelBundle
from isolab.sampling_params import SamplingParams

BS = 16


@dataclass(frozen=True)
class Arrival:
    step: int
    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    scope: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # the fault it is built to expose
    what: str
    kv_blocks: int
    build: Callable[[ModelBundle, random.Random], list[Arrival]]


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


def _reuse(b: ModelBundle, rng: random.Random) -> list[Arrival]:
    # A's first block is cached; B2 evicts and rewrites it (unsealed) while A' asks for it again.
    a = _tokens(rng, b, 24)
    return [
        Arrival(0, "A", a, _greedy(4)),
        Arrival(6, "B1", _tokens(rng, b, 20), _greedy(1)),
        Arrival(6, "B2", _tokens(rng, b, 4), _greedy(30)),
        Arrival(8, "A2", a, _greedy(6)),
    ]


def _coarse(b: ModelBundle, rng: random.Random) -> list[Arrival]:
    # Two different prompts of equal length, one after the other.
    return [Arrival(0, "X", _tokens(rng, b, 24), _greedy(6)), Arrival(8, "Y", _tokens(rng, b, 24), _greedy(6))]


def _weak(b: ModelBundle, rng: random.Random) -> list[Arrival]:
    # Y's first block differs from X's but its 8-bit key collides (found by search: 1 in 256).
    extra = ExtraKeys(b.fingerprint, b.dtype, None)
    x = _tokens(rng, b, 24)
    target = weak(block_key(None, x[:BS], extra))
    while True:
        y = _tokens(rng, b, 24)
        if y[:BS] != x[:BS] and weak(block_key(None, y[:BS], extra)) == target:
            break
    return [Arrival(0, "X", x, _greedy(6)), Arrival(8, "Y", y, _greedy(6))]


def _scope(b: ModelBundle, rng: random.Random) -> list[Arrival]:
    p = _tokens(rng, b, 40)
    return [Arrival(0, "tenantA", p, _greedy(4), scope="A"), Arrival(6, "tenantB", p, _greedy(4), scope="B")]


def _write_shared(b: ModelBundle, rng: random.Random) -> list[Arrival]:
    # Y extends X's prompt while X decodes: only X's sealed blocks may be shared, never its tail.
    p = _tokens(rng, b, 40)
    return [Arrival(0, "X", p, _greedy(12)), Arrival(1, "Y", p + _tokens(rng, b, 10), _greedy(4))]


def _rng(b: ModelBundle, rng: random.Random) -> list[Arrival]:
    mk = lambda seed: SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0)  # noqa: E731
    return [Arrival(0, "S1", _tokens(rng, b, 12), mk(1)), Arrival(0, "S2", _tokens(rng, b, 12), mk(2))]


def _wide(b: ModelBundle, rng: random.Random) -> list[Arrival]:
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


def make_engine(bundle: ModelBundle, kv_blocks: int, *, faults: frozenset[str] = frozenset(), audit: bool = False,
                prefix: bool = True) -> LLMEngine:
    per_block = bytes_per_block(bundle.hparams, BS, bundle.model.dtype)
    cfg = EngineConfig(
        model=str(bundle.path), dtype=bundle.dtype, cache=CacheConfig(BS, per_block * (kv_blocks + 1), prefix),
        scheduler=SchedulerConfig(16, 256), audit=audit, inject_faults=faults,
    )
    return LLMEngine(cfg, bundle)


def _drive(eng: LLMEngine, arrivals: list[Arrival], check_invariants: bool) -> tuple[dict, dict, list[str]]:
    pending = sorted(arrivals, key=lambda a: a.step)
    tokens: dict[str, tuple[tuple[int, float], ...]] = {}  # (token, logprob) per output position
    cached: dict[str, int] = {}
    seen: dict[str, list[tuple[int, float]]] = {}
    problems: list[str] = []
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            eng.add_request(a.rid, list(a.prompt), a.params, a.scope)
        for o in eng.step():
            seen.setdefault(o.request_id, []).extend((lp.token_id, lp.logprob) for lp in o.new_logprobs)
            if o.error is not None:
                problems.append(f"audit: {o.error}")
                continue
            if o.finished:
                tokens[o.request_id] = tuple(seen[o.request_id])
                cached[o.request_id] = o.num_cached_tokens
        if check_invariants:
            try:
                eng.pool.check_invariants()
            except AssertionError as exc:
                problems.append(f"invariants: step {step}: {exc}")
                check_invariants = False  # report the first breach only
        step += 1
        assert step < 10_000, "scenario did not finish"
    return tokens, cached, problems


def run_scenario(bundle: ModelBundle, sc: Scenario, faults: frozenset[str] = frozenset(), *, audit: bool = False,
                 seed: int = 0) -> Report:
    arrivals = sc.build(bundle, random.Random(seed))
    report = Report(sc.name, tuple(sorted(faults)), audit)
    eng = make_engine(bundle, sc.kv_blocks, faults=faults, audit=audit)
    tokens, cached, problems = _drive(eng, arrivals, check_invariants=True)
    if not eng.model.numerics.invariant:
        problems.append(f"numerics: {eng.model.numerics.summary()}")
    for p in problems:
        kind = p.split(":", 1)[0]
        if kind not in report.caught_by:
            report.caught_by.append(kind)
        report.details.append(p)
    # Reference: each request alone on a clean engine without a prefix cache.
    ref = make_engine(bundle, 64, prefix=False)
    for a in arrivals:
        if a.rid not in tokens:
            continue  # aborted by audit
        alone, _, _ = _drive(ref, [Arrival(0, a.rid, a.prompt, a.params)], check_invariants=False)
        got, want = tokens[a.rid], alone[a.rid]  # tokens and their logprobs, bit for bit
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
