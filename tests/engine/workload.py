"""A mixed-request workload driver for the isolation guarantee tests (random arrivals, shared
prefixes, cancellations), and the solo reference it is compared with."""

from __future__ import annotations

import random
from dataclasses import dataclass

from isolab.config import CacheConfig, EngineConfig, SchedulerConfig
from isolab.engine.llm_engine import LLMEngine, empty_cache_check
from isolab.sampling_params import SamplingParams


@dataclass(frozen=True)
class Spec:
    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrive_step: int
    cancel_step: int | None  # cancelled this many steps after arrival (None: runs to the end)


def make_specs(n: int, vocab: int, seed: int, *, max_prompt: int = 80, max_new: int = 24, cancel_share: float = 0.1,
               spread: int = 40, lo: int = 3) -> list[Spec]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(lo, vocab) for _ in range(rng.choice([16, 32, 40]))) for _ in range(4)]
    specs = []
    for i in range(n):
        body = tuple(rng.randrange(lo, vocab) for _ in range(rng.randint(1, max_prompt)))
        prompt = (prefixes[rng.randrange(4)] + body) if rng.random() < 0.5 else body
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0.0, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0.9, top_p=0.9, top_k=rng.choice([0, 20]),
                                    seed=rng.randrange(1 << 30), logprobs=2, ignore_eos=True)
        cancel = rng.randint(1, 10) if rng.random() < cancel_share else None
        specs.append(Spec(f"r{i}", prompt, params, rng.randint(0, spread), cancel))
    return specs


def engine(bundle, *, kv_blocks: int, block_size: int = 16, prefix: bool = True, budget: int = 128, max_seqs: int = 32,
           audit: bool = False, faults: frozenset[str] = frozenset()) -> LLMEngine:
    from isolab.engine.kv_storage import bytes_per_block

    per_block = bytes_per_block(bundle.hparams, block_size, bundle.model.dtype)
    cfg = EngineConfig(
        model=str(bundle.path), dtype=bundle.dtype, cache=CacheConfig(block_size, per_block * (kv_blocks + 1), prefix),
        scheduler=SchedulerConfig(max_seqs, budget), audit=audit, inject_faults=faults,
    )
    return LLMEngine(cfg, bundle)


Result = tuple[tuple[int, ...], tuple[tuple[float, tuple[tuple[int, float], ...]], ...], int]


def run_mixed(eng: LLMEngine, specs: list[Spec], max_steps: int = 100_000) -> dict[str, Result]:
    """Run specs with their arrivals and cancellations; returns rid -> (tokens, logprobs, cached)."""
    pending = sorted(specs, key=lambda s: s.arrive_step)
    arrived: dict[str, int] = {}
    results: dict[str, Result] = {}
    lps: dict[str, list] = {s.rid: [] for s in specs}
    by_id = {s.rid: s for s in specs}
    step = 0
    while (pending or eng.has_unfinished()) and step < max_steps:
        while pending and pending[0].arrive_step <= step:
            s = pending.pop(0)
            eng.add_request(s.rid, list(s.prompt), s.params)
            arrived[s.rid] = step
        for rid, at in list(arrived.items()):
            c = by_id[rid].cancel_step
            if c is not None and step - at >= c and rid not in results:
                eng.abort(rid)
                del arrived[rid]
        for o in eng.step():
            lps[o.request_id].extend((lp.logprob, lp.top) for lp in o.new_logprobs)
            if o.finished:
                assert o.error is None, o.error
                results[o.request_id] = (o.output_token_ids, tuple(lps[o.request_id]), o.num_cached_tokens)
                arrived.pop(o.request_id, None)
        step += 1
    assert step < max_steps, "the workload did not finish"
    empty_cache_check(eng)
    return results


def run_solo(bundle, specs: list[Spec], **kw) -> dict[str, Result]:
    """Each request alone in an engine with no prefix cache: the reference."""
    eng = engine(bundle, prefix=False, **kw)
    out = {}
    for s in specs:
        out.update(run_mixed(eng, [Spec(s.rid, s.prompt, s.params, 0, None)]))
    return out
