"""Owns running the four questions as experiments against a target, and the in-process engine target.

Does not judge (verdict.py) nor talk HTTP (http_target.py). A target runs a list of items either
each alone (a fresh engine, or one request in flight) or together: requests are admitted in
order, at most one new one per engine step (or per `stagger` seconds on a server), while fewer
than `concurrency` are in flight; so repeats and extensions arrive after their first send has
been computed, which is when a cache can serve them.

    alone x2      the reference, and whether the symptom shows with nothing else running
    together @c   c = 1, 2, 4, 8, 16, original content            (a), (c)
    variant @max  same lengths, repeats and shared prefixes, other content   (b)
    cache off @c  the same together runs with the prefix cache off          (d)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from isolab.doctor.symptoms import Check, Result, Symptom, find_symptoms, foreign_hits
from isolab.doctor.verdict import Findings, RunRecord, cache_unexercised, served_from_cache
from isolab.doctor.workload import Item
from isolab.errors import InvalidRequestError

CONCURRENCIES = (1, 2, 4, 8, 16)


class Target(Protocol):
    name: str
    exact: bool  # bit-exact engine: any difference from the solo run is a symptom
    can_disable_cache: bool
    alone_label: str  # how the solo run is made, for the report's first row

    def prepare(self, items: Sequence[Item]) -> list[Item]: ...

    def variant(self, items: Sequence[Item], seed: int) -> list[Item]: ...

    def alone(self, item: Item) -> Result: ...

    def together(self, items: Sequence[Item], concurrency: int, prefix_cache: bool) -> tuple[list[tuple[Item, Result]], dict]: ...


class EngineTarget:
    """An isolab engine in this process; one fresh engine per run."""

    exact = True
    can_disable_cache = True
    alone_label = "alone (fresh engine each)"

    def __init__(self, llm_kwargs: dict, bundle: object | None = None) -> None:
        from isolab.models.bundle import load_bundle

        self.kwargs = dict(llm_kwargs)
        self.trace_path = self.kwargs.pop("trace_path", None)  # traces the first together run at max load
        self.bundle = bundle or load_bundle(self.kwargs.get("model"), self.kwargs.get("dtype", "bf16"), self.kwargs.get("device"),
                                                 weights=self.kwargs.get("weights", "auto"))
        self.tokenizer = self.bundle.tokenizer  # type: ignore[attr-defined]
        faults = ",".join(self.kwargs.get("inject_faults", ())) or "none"
        self.name = f"isolab engine ({self.bundle.name}, faults: {faults}, audit: {self.kwargs.get('audit', False)})"  # type: ignore[attr-defined]

    def new_engine(self, prefix_cache: bool, kv_bytes: int | None = None, trace: str | None = None):  # noqa: ANN202
        """A fresh LLMEngine on the shared weights; kv_bytes caps the pool, trace turns the trace on."""
        from isolab.llm import LLM

        kw = dict(self.kwargs, enable_prefix_caching=prefix_cache and self.kwargs.get("enable_prefix_caching", True), trace_path=trace)
        if kv_bytes is not None:
            kw["kv_cache_memory"] = min(kv_bytes, kw.get("kv_cache_memory", kv_bytes))
        return LLM(bundle=cast(Any, self.bundle), **kw).engine

    def prepare(self, items: Sequence[Item]) -> list[Item]:
        from dataclasses import replace

        return [replace(it, prompt=tuple(self.tokenizer.encode(it.prompt)), text=it.prompt) if isinstance(it.prompt, str) else it
                for it in items]

    def variant(self, items: Sequence[Item], seed: int) -> list[Item]:
        from isolab.doctor.workload import token_variant

        vocab = self.bundle.hparams.vocab_size  # type: ignore[attr-defined]
        return token_variant(items, seed, min(100, vocab // 4), vocab)

    def alone(self, item: Item) -> Result:
        from isolab.engine.kv_storage import kv_cache_memory_for

        bs = self.kwargs.get("block_size", 16)
        blocks = -(-(len(item.prompt) + item.max_tokens) // bs) + 1  # the request's blocks, and one spare
        memory = kv_cache_memory_for(self.bundle.hparams, bs, self.bundle.model.dtype, blocks)  # type: ignore[attr-defined]
        eng = self.new_engine(True, memory)  # a pool sized for one request: same outputs, less to set up
        (_, res), = drive(eng, [item], 1)
        eng.close()
        return res

    def numerics(self) -> tuple[str, bool]:
        """The engine's numerics path and its start-up invariance verdict (models/invariance.py)."""
        eng = self.new_engine(True, 1 << 20)
        report = eng.numerics
        eng.close()
        return report.numerics, report.invariant

    def together(self, items: Sequence[Item], concurrency: int, prefix_cache: bool) -> tuple[list[tuple[Item, Result]], dict]:
        trace, self.trace_path = self.trace_path, None
        eng = self.new_engine(prefix_cache, trace=trace)
        out = drive(eng, items, concurrency)
        stats = eng.stats()
        eng.close()
        keep = ("prefix_cache_hits_tokens", "evictions", "preemptions", "audit_violations", "steps")
        return out, {k: stats[k] for k in keep}


def _params(it: Item):  # noqa: ANN202
    from isolab.sampling_params import SamplingParams

    return SamplingParams(max_tokens=it.max_tokens, temperature=it.temperature, seed=it.seed, ignore_eos=True, logprobs=5)


def drive(engine, items: Sequence[Item], concurrency: int) -> list[tuple[Item, Result]]:  # noqa: ANN001
    """Admit items in order, one per step, while fewer than `concurrency` run; results in admission order."""
    from isolab.testing import workload

    arrivals = [workload.Arrival(0, it.item_id, tuple(cast("tuple[int, ...]", it.prompt)), _params(it), it.scope) for it in items]
    run = workload.drive(engine, arrivals, max_in_flight=concurrency, max_admit_per_step=1)
    by_id = {it.item_id: it for it in items}
    out = []
    for rid in run.admitted:
        f = run.finished[rid]
        out.append((by_id[rid], Result(
            rid, f.token_ids, tuple(lp.logprob for lp in f.logprobs), tuple(dict(lp.top) for lp in f.logprobs),
            engine.tokenizer.decode(f.token_ids), f.num_cached_tokens, None if f.error is None else str(f.error),
        )))
    return out


def diagnose(
    target: Target,
    items: Sequence[Item],
    *,
    concurrencies: Sequence[int] = CONCURRENCIES,
    checks: Sequence[Check] = (),
    tie_margin: float = 0.1,
    variant_seed: int = 1,
    log: Callable[[str], None] = lambda s: None,
) -> Findings:
    items = target.prepare(items)
    exact = target.exact
    log(f"alone: {len(items)} requests, each twice")
    refs = {it.item_id: target.alone(it) for it in items}
    if all(r.error is not None for r in refs.values()):
        first = next(iter(refs.values())).error
        raise InvalidRequestError(f"every request failed even alone, e.g.: {first}", field="target")
    again = {it.item_id: target.alone(it) for it in items}
    alone_sym = find_symptoms(items, again, refs, exact=exact, tie_margin=tie_margin, checks=checks)
    alone_sym += [s for s in find_symptoms(items, refs, refs, exact=exact, checks=checks, errors_alone_too=True)
                  if s.kind != "differs"]
    # a server's cache outlives each alone request: a hit from another scope's alone request is a symptom too
    alone_sym += foreign_hits(getattr(target, "cross_scope_history", list)())
    alone = RunRecord(target.alone_label, "original", None, True, len(items), alone_sym, {})

    def together(its: Sequence[Item], rf: dict[str, Result], c: int, cache: bool, content: str, chk: Sequence[Check]) -> RunRecord:
        log(f"together: concurrency {c}, prefix cache {'on' if cache else 'off'}, {content} content")
        history: list[tuple[Item, Result]] = getattr(target, "cross_scope_history", list)()  # a server's cache outlives a run
        admitted, stats = target.together(its, c, cache)
        res = {it.item_id: r for it, r in admitted}
        sym = find_symptoms(its, res, rf, exact=exact, tie_margin=tie_margin, checks=chk)
        sym += foreign_hits(admitted, history)
        return RunRecord(f"together c={c}", content, c, cache, len(its), sym, stats)

    top = max(concurrencies)
    # The top concurrency runs first, so that a --trace in the engine args records it.
    sweep = [together(items, refs, c, True, "original", checks) for c in sorted(concurrencies, reverse=True)][::-1]
    var_items = target.variant(items, variant_seed)
    log("variant: same lengths, other content, alone")
    var_refs = {it.item_id: target.alone(it) for it in var_items}
    variant = together(var_items, var_refs, top, True, "variant", ())  # the user's check is about the original content
    nocache: list[RunRecord] = []
    if target.can_disable_cache:
        cs = [r.concurrency for r in sweep if r.symptoms] or [top]
        nocache = [together(items, refs, c, False, "original", checks) for c in cs]  # type: ignore[arg-type]
    reported = getattr(target, "numerics", lambda: None)()  # (path, invariant) where the target says
    numerics, invariant = reported if reported else (None, None)
    warnings = vacuity_warnings(sweep)
    failed = [r.error for r in var_refs.values() if r.error is not None]
    if failed:
        warnings.append(f"{len(failed)} of {len(var_refs)} variant requests failed even alone (e.g. {failed[0][:120]}): "
                        "question (b) rests on the others (their errors together are not symptoms)")
    if nocache and served_from_cache(nocache):
        warnings.append(f"the cache-off runs were served {served_from_cache(nocache)} cached tokens: the server "
                        "ignores the --no-cache-field given, so question (d) could not be asked")
    return Findings(target.name, alone, sweep, variant, nocache, warnings, numerics, invariant)


def vacuity_warnings(sweep: Sequence[RunRecord]) -> list[str]:
    """A cache that never served a token cannot show a cache fault: say so rather than pass."""
    if cache_unexercised(sweep):
        return ["the prefix cache served no tokens in any run (or the server does not report cached_tokens): "
                "a cache fault could not have shown; use prompts that share at least one full block"]
    return []


def symptoms_by_kind(symptoms: Sequence[Symptom]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in symptoms:
        out[s.kind] = out.get(s.kind, 0) + 1
    return out
